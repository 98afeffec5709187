//! `callreg-model`: checks the callreg registration protocol exhaustively
//! (`check`) or serves stateright's Explorer over it (`explore`). See
//! `specs/model.md`.
//!
//! Exit status (the scheme of `callreg`: 0 success, 1 a negative verdict,
//! 2 a usage error; then 3 for an incomplete run): 0 when every run is
//! complete, no property failed and every expected witness was found; 1
//! when a property failed or an expected witness is missing; 2 for a bad
//! command line, script or configuration, or an address `explore` cannot
//! listen on; 3 when a run is incomplete (`--max-depth` was reached) and
//! nothing failed. 1 comes before 3: `--first` stops a run only at a
//! failed property, so such a run exits 1.

use std::process::ExitCode;
use std::time::Duration;

use callreg_model::configs::{self, Named};
use callreg_model::model::{ModelConfig, RegistrationModel};
use callreg_model::run::{check, check_named, Outcome, SearchOptions};
use callreg_model::script::Script;
use clap::{Args, Parser, Subcommand};
use stateright::Model;

/// Every run complete, no property failed, every expected witness found.
const EXIT_OK: u8 = 0;
/// A property failed, or an expected witness is missing.
const EXIT_VIOLATION: u8 = 1;
/// A bad command line, script or configuration, or an unusable address.
const EXIT_USAGE: u8 = 2;
/// A run is incomplete (`--max-depth`) and nothing failed.
const EXIT_INCOMPLETE: u8 = 3;

const EXIT_CODES: &str = "Exit status:
  0  every run complete, no property failed, every expected witness found
  1  a property failed, or a witness the configuration must produce is missing
  2  bad command line, script or configuration; explore: cannot listen on the address
  3  a run is incomplete (--max-depth was reached) and nothing failed;
     a run --first stopped at a failed property exits 1";

#[derive(Parser, Debug)]
#[command(
    name = "callreg-model",
    version,
    args_override_self = true,
    about = "Model-check the callreg registration protocol (the library's own state machines) with faults",
    after_help = EXIT_CODES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The configuration flags a named configuration (`--config`, `--all`)
/// replaces; `--mutant` combines with both.
const CONFIG_FLAGS: [&str; 25] = [
    "targets",
    "script",
    "crashes",
    "deserialize_failures",
    "stage_failures",
    "corruptions",
    "deadlines",
    "poison_kills",
    "no_probe",
    "tasks",
    "cancels",
    "task_deadline",
    "stale_results",
    "stale_replies",
    "heartbeats",
    "no_fence",
    "slots",
    "interleave_start",
    "closes",
    "forged",
    "wrong_digests",
    "respawn_limit",
    "spawn_failures",
    "restage_failures",
    "template_losses",
];

#[derive(Subcommand, Debug)]
enum Command {
    /// Explore every reachable state and check every property.
    #[command(after_help = EXIT_CODES)]
    Check {
        #[command(flatten)]
        config: ConfigArgs,
        /// Check this named configuration (see `list`) instead of the flags.
        #[arg(long = "config", value_name = "NAME", conflicts_with_all = CONFIG_FLAGS)]
        config_name: Option<String>,
        /// Check every named configuration (see `list`), one after another.
        #[arg(long, conflicts_with_all = CONFIG_FLAGS, conflicts_with = "config_name")]
        all: bool,
        /// Merge states that differ only by renumbering targets (runs depth first).
        #[arg(long)]
        symmetry: bool,
        /// Search depth first (default: breadth first, shortest counterexamples).
        #[arg(long)]
        dfs: bool,
        /// Checker threads, at least 1 (default: available cores).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        threads: Option<u64>,
        /// Stop below this depth, at least 1 (the run is then reported incomplete).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        max_depth: Option<u64>,
        /// Stop at the first violation (faster; the run is then incomplete, and exits 1).
        #[arg(long)]
        first: bool,
        /// Seconds between progress lines on stderr (0: none).
        #[arg(long, default_value_t = 5)]
        progress_secs: u64,
        /// Print the result as one JSON document on stdout (everything else goes to stderr).
        #[arg(long)]
        json: bool,
    },
    /// Serve stateright's Explorer (a web UI over the state space).
    #[command(after_help = EXIT_CODES)]
    Explore {
        #[command(flatten)]
        config: ConfigArgs,
        /// Serve this named configuration (see `list`) instead of the flags.
        #[arg(long = "config", value_name = "NAME", conflicts_with_all = CONFIG_FLAGS)]
        config_name: Option<String>,
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:3000")]
        addr: String,
    },
    /// List the built-in scripts, named configurations and mutants.
    List,
}

#[derive(Args, Debug)]
struct ConfigArgs {
    /// Number of targets.
    #[arg(long, default_value_t = 3)]
    targets: u16,
    /// A built-in script name (see `list`) or a JSON script file.
    #[arg(long, default_value = "register-unregister-same-digest")]
    script: String,
    /// Target crashes allowed.
    #[arg(long, default_value_t = 1)]
    crashes: u8,
    /// Failed deserializations allowed.
    #[arg(long, default_value_t = 1)]
    deserialize_failures: u8,
    /// Registers whose payload may fail to be staged in shared memory.
    #[arg(long, default_value_t = 0)]
    stage_failures: u8,
    /// Corrupted staged payloads allowed.
    #[arg(long, default_value_t = 1)]
    corruptions: u8,
    /// Passing deadlines allowed.
    #[arg(long, default_value_t = 1)]
    deadlines: u8,
    /// Tasks the client may dispatch.
    #[arg(long, default_value_t = 1)]
    tasks: u8,
    /// Cancels of tasks in flight the client may send.
    #[arg(long, default_value_t = 0)]
    cancels: u8,
    /// Submit every task with a timeout of one control timeout, counted
    /// from its start report; its deadline passes like any deadline
    /// (--deadlines).
    #[arg(long)]
    task_deadline: bool,
    /// Task results of a fenced process that may still reach the parent
    /// later, tagged with the old incarnation (stale results).
    #[arg(long, default_value_t = 0)]
    stale_results: u8,
    /// Control replies of a lost process that may still reach the parent
    /// after the loss, before or after its target's replacement started or
    /// joined (stale replies).
    #[arg(long, default_value_t = 0)]
    stale_replies: u8,
    /// Heartbeats targets may send (each reports alive every control the
    /// parent awaits from its target, just before the earliest deadline).
    #[arg(long, default_value_t = 0)]
    heartbeats: u8,
    /// At a passed deadline, do not fence the silent target (the digest becomes uncertain).
    #[arg(long)]
    no_fence: bool,
    /// Slots per target.
    #[arg(long, default_value_t = 2)]
    slots: u16,
    /// Targets (comma-separated ids) on which the startup snapshot's first
    /// digest fails to install.
    #[arg(long, value_delimiter = ',', value_name = "TARGETS")]
    snapshot_failures: Vec<u16>,
    /// Make the script's pre-start steps and start actions (steps after start must be refused).
    #[arg(long)]
    interleave_start: bool,
    /// Closes of the Worker allowed (0 or 1), with operations possibly in flight.
    #[arg(long, default_value_t = 0)]
    closes: u8,
    /// Offer forged and out-of-range inputs in every state (each must be refused).
    #[arg(long)]
    forged: bool,
    /// Replies that may name a wrong digest (a misbehaving target).
    #[arg(long, default_value_t = 0)]
    wrong_digests: u8,
    /// Deserializations that may kill their target (a poison payload).
    #[arg(long, default_value_t = 0)]
    poison_kills: u8,
    /// Deserializations that may end refused as poisoned (REGISTER_POISONED:
    /// a target that is itself a registry whose own probe lost a process);
    /// the target stays alive.
    #[arg(long, default_value_t = 0)]
    poison_refusals: u8,
    /// Send every register to every live target at once (probe-first off).
    #[arg(long)]
    no_probe: bool,
    /// Replacement targets (specs/protocol.md §2.9): 0 = off; otherwise a
    /// lost target gets a new process, and this many replacements of one target
    /// in a row may be lost before they join.
    #[arg(long, default_value_t = 0)]
    respawn_limit: u16,
    /// Replacements that may fail to start.
    #[arg(long, default_value_t = 0)]
    spawn_failures: u8,
    /// Replays that may fail to stage their payload for a joining
    /// replacement (its join then fails).
    #[arg(long, default_value_t = 0)]
    restage_failures: u8,
    /// Template process losses (no replacement starts after one).
    #[arg(long, default_value_t = 0)]
    template_losses: u8,
    /// Replacements are arrivals (specs/protocol.md §2.9 "Arrivals"): a
    /// target asked for waits for its process with no ready deadline.
    #[arg(long)]
    arrivals: bool,
    /// Every loss is a departure (specs/protocol.md §2.8 "A departure"):
    /// end of file is reported with `target_left`, never evidence.
    #[arg(long)]
    departures: bool,
    /// Tasks are submitted with no target (specs/protocol.md §2.14): the
    /// parent picks it, or keeps the task until a target takes tasks.
    #[arg(long)]
    submit_any: bool,
    /// At most this many tasks per target process, then it retires and is
    /// replaced (specs/protocol.md §2.14; 0: no bound; needs
    /// --respawn-limit above 0 to take effect).
    #[arg(long, default_value_t = 0)]
    max_tasks_per_target: u32,
    /// Switch on a known bug (see `list`); needs the `mutants` feature.
    #[arg(long)]
    mutant: Option<String>,
}

fn load_script(name: &str) -> Result<Script, String> {
    if let Some(script) = Script::named(name) {
        return Ok(script);
    }
    let unreadable =
        |why: String| format!("{name:?} is neither a built-in script nor a readable file: {why}");
    // A FIFO or a device is refused before anything is read (a FIFO with
    // no writer would block for ever, /dev/zero would grow without bound).
    let metadata = std::fs::metadata(name).map_err(|e| unreadable(e.to_string()))?;
    if !metadata.is_file() {
        return Err(unreadable("not a regular file".to_owned()));
    }
    let text = std::fs::read_to_string(name).map_err(|e| unreadable(e.to_string()))?;
    Script::from_json(&text).map_err(|e| format!("{name}: {e}"))
}

/// The configuration the flags describe (without the mutant).
fn config_of(args: &ConfigArgs) -> Result<ModelConfig, String> {
    Ok(ModelConfig {
        targets: args.targets,
        script: load_script(&args.script)?,
        crashes: args.crashes,
        deserialize_failures: args.deserialize_failures,
        stage_failures: args.stage_failures,
        corruptions: args.corruptions,
        deadlines: args.deadlines,
        tasks: args.tasks,
        cancels: args.cancels,
        task_deadline: args.task_deadline,
        stale_results: args.stale_results,
        stale_replies: args.stale_replies,
        heartbeats: args.heartbeats,
        fence_on_timeout: !args.no_fence,
        slot_capacity: args.slots,
        snapshot_failures: args.snapshot_failures.clone(),
        interleave_start: args.interleave_start,
        closes: args.closes,
        forged: args.forged,
        wrong_digests: args.wrong_digests,
        probe_first: !args.no_probe,
        poison_kills: args.poison_kills,
        poison_refusals: args.poison_refusals,
        respawn_limit: args.respawn_limit,
        spawn_failures: args.spawn_failures,
        restage_failures: args.restage_failures,
        template_losses: args.template_losses,
        arrivals: args.arrivals,
        departures: args.departures,
        submit_any: args.submit_any,
        max_tasks_per_target: args.max_tasks_per_target,
        #[cfg(feature = "mutants")]
        mutant: None,
    })
}

/// Switches `mutant` (a `--mutant` name) on in `config`; a mutant whose
/// code path fencing never reaches switches fencing off, with a notice.
#[cfg_attr(not(feature = "mutants"), allow(unused_mut))]
fn with_mutant(mut config: ModelConfig, mutant: Option<&str>) -> Result<ModelConfig, String> {
    let Some(name) = mutant else {
        return Ok(config);
    };
    #[cfg(not(feature = "mutants"))]
    {
        let _ = name;
        Err("--mutant needs callreg-model built with the `mutants` feature".into())
    }
    #[cfg(feature = "mutants")]
    {
        use callreg_model::model::{
            mutant_name, mutant_named, mutant_needs_no_fence, mutant_needs_poison_refusals,
            mutant_needs_respawn,
        };
        let mutant = mutant_named(name)
            .ok_or_else(|| format!("unknown mutant {name:?}; `callreg-model list` shows them"))?;
        if mutant_needs_no_fence(mutant) {
            if config.fence_on_timeout {
                eprintln!(
                    "callreg-model: notice: --mutant {} implies --no-fence (a fenced target never leaves a digest uncertain)",
                    mutant_name(mutant)
                );
                config.fence_on_timeout = false;
            }
            if config.deadlines == 0 {
                eprintln!(
                    "callreg-model: warning: --mutant {} cannot be reached with --deadlines 0 (only a passed deadline leaves a digest uncertain)",
                    mutant_name(mutant)
                );
            }
        }
        if mutant_needs_respawn(mutant) && config.respawn_limit == 0 {
            eprintln!(
                "callreg-model: notice: --mutant {} implies --respawn-limit 1 (only a replacement target joins)",
                mutant_name(mutant)
            );
            config.respawn_limit = 1;
        }
        if mutant_needs_poison_refusals(mutant) && config.poison_refusals == 0 {
            eprintln!(
                "callreg-model: notice: --mutant {} implies --poison-refusals 1 (only a target's refusal as poisoned reaches it)",
                mutant_name(mutant)
            );
            config.poison_refusals = 1;
        }
        config.mutant = Some(mutant);
        Ok(config)
    }
}

fn named_config(name: &str) -> Result<Named, String> {
    configs::named(name)
        .ok_or_else(|| format!("unknown configuration {name:?}; `callreg-model list` shows them"))
}

/// The human-readable report of one run, line by line.
fn human(outcome: &Outcome) -> Vec<String> {
    let mut lines = Vec::new();
    for violation in &outcome.violations {
        lines.push(format!("VIOLATION of {:?}:", violation.property));
        for (i, line) in violation.trace.iter().enumerate() {
            if line.starts_with("=>") || line.starts_with("   ") {
                lines.push(format!("  {line}"));
            } else {
                lines.push(format!("  {:>3}. {line}", i + 1));
            }
        }
    }
    for name in &outcome.witnessed {
        lines.push(format!("witnessed: {name}"));
    }
    for name in &outcome.not_witnessed {
        lines.push(format!("not witnessed in this configuration: {name}"));
    }
    for name in &outcome.missing_witnesses {
        lines.push(format!(
            "MISSING WITNESS (this configuration must reach it): {name}"
        ));
    }
    lines.push(format!(
        "{}: {} unique states, {} states, max depth {}, {:.2} s ({:.0} unique states/s); {} violation(s), {} missing witness(es)",
        if outcome.complete {
            "complete"
        } else {
            "INCOMPLETE"
        },
        outcome.unique_states,
        outcome.states,
        outcome.max_depth,
        outcome.secs,
        outcome.states_per_sec(),
        outcome.violations.len(),
        outcome.missing_witnesses.len()
    ));
    lines
}

fn exit_status(outcomes: &[&Outcome]) -> u8 {
    if outcomes
        .iter()
        .any(|o| !o.violations.is_empty() || !o.missing_witnesses.is_empty())
    {
        EXIT_VIOLATION
    } else if outcomes.iter().any(|o| !o.complete) {
        EXIT_INCOMPLETE
    } else {
        EXIT_OK
    }
}

/// Prints a report line: on stdout, or on stderr when stdout carries the
/// JSON document.
fn say(json: bool, line: &str) {
    if json {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
}

fn usage(message: &str) -> ExitCode {
    eprintln!("callreg-model: {message}");
    ExitCode::from(EXIT_USAGE)
}

fn main() -> ExitCode {
    // Usage errors exit 2, as in `callreg` (and clap); help and version 0.
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let usage_error = e.use_stderr();
            // Printing to a closed stdout/stderr is not worth a panic.
            let _ = e.print();
            return if usage_error {
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::from(EXIT_OK)
            };
        }
    };
    match cli.command {
        Command::List => {
            for script in Script::builtin() {
                println!("script {}: {}", script.name, script.description);
            }
            for named in configs::all() {
                println!(
                    "config {}: {}; must witness: {}",
                    named.name,
                    named.description,
                    named.expectations().join(", ")
                );
            }
            #[cfg(feature = "mutants")]
            for mutant in callreg::protocol::Mutant::ALL {
                let name = callreg_model::model::mutant_name(*mutant);
                if callreg_model::model::mutant_needs_respawn(*mutant) {
                    println!("mutant {name} (reachable only with --respawn-limit 1 or more and a way to lose a target; --mutant {name} implies --respawn-limit 1)");
                } else if callreg_model::model::mutant_needs_poison_refusals(*mutant) {
                    println!("mutant {name} (reachable only with --poison-refusals 1 or more and probe-first on; --mutant {name} implies --poison-refusals 1)");
                } else if callreg_model::model::mutant_needs_no_fence(*mutant) {
                    println!("mutant {name} (reachable only with --no-fence and --deadlines 1 or more; --mutant {name} implies --no-fence)");
                } else {
                    println!("mutant {name} (reachable with fencing on or off)");
                }
            }
            ExitCode::from(EXIT_OK)
        }
        Command::Explore {
            config,
            config_name,
            addr,
        } => {
            let built = match &config_name {
                Some(name) => named_config(name).map(|n| n.config),
                None => config_of(&config),
            }
            .and_then(|c| with_mutant(c, config.mutant.as_deref()))
            .and_then(|c| RegistrationModel::new(c).map_err(|e| e.to_string()));
            let model = match built {
                Ok(m) => m,
                Err(e) => return usage(&e),
            };
            // Stateright's server panics on a bind failure: check first.
            // (The probe listener is dropped before the server binds.)
            if let Err(e) = std::net::TcpListener::bind(addr.as_str()) {
                return usage(&format!("cannot listen on {addr}: {e}"));
            }
            eprintln!("serving the Explorer on http://{addr}");
            let checker = model.checker().serve(addr.as_str());
            drop(checker);
            ExitCode::from(EXIT_OK)
        }
        Command::Check {
            config,
            config_name,
            all,
            symmetry,
            dfs,
            threads,
            max_depth,
            first,
            progress_secs,
            json,
        } => {
            let threads = threads.map_or_else(
                || std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
                |n| usize::try_from(n).unwrap_or(usize::MAX),
            );
            let options = SearchOptions {
                symmetry,
                dfs,
                threads,
                max_depth: max_depth.map(|d| usize::try_from(d).unwrap_or(usize::MAX)),
                progress_every: (progress_secs > 0).then(|| Duration::from_secs(progress_secs)),
                stop_at_first_violation: first,
            };
            let mutant = config.mutant.as_deref();
            let named: Vec<Named> = if all {
                configs::all()
            } else if let Some(name) = &config_name {
                match named_config(name) {
                    Ok(n) => vec![n],
                    Err(e) => return usage(&e),
                }
            } else {
                Vec::new()
            };
            if named.is_empty() {
                let model = match config_of(&config)
                    .and_then(|c| with_mutant(c, mutant))
                    .and_then(|c| RegistrationModel::new(c).map_err(|e| e.to_string()))
                {
                    Ok(m) => m,
                    Err(e) => return usage(&e),
                };
                let outcome = check(model, &options);
                for line in human(&outcome) {
                    say(json, &line);
                }
                if json {
                    println!("{}", outcome_json(&outcome));
                }
                return ExitCode::from(exit_status(&[&outcome]));
            }
            let mut results = Vec::new();
            for mut n in named {
                n.config = match with_mutant(n.config, mutant) {
                    Ok(c) => c,
                    Err(e) => return usage(&e),
                };
                say(
                    json,
                    &format!("== configuration {}: {}", n.name, n.description),
                );
                let outcome = match check_named(&n, &options) {
                    Ok(o) => o,
                    Err(e) => return usage(&format!("configuration {}: {e}", n.name)),
                };
                for line in human(&outcome) {
                    say(json, &line);
                }
                results.push((n.name, outcome));
            }
            let outcomes: Vec<&Outcome> = results.iter().map(|(_, o)| o).collect();
            let status = exit_status(&outcomes);
            if json {
                let document = if all {
                    serde_json::json!({
                        "passed": status == EXIT_OK,
                        "configurations": results
                            .iter()
                            .map(|(name, o)| {
                                let mut v = outcome_json(o);
                                v["name"] = serde_json::json!(name);
                                v
                            })
                            .collect::<Vec<_>>(),
                    })
                } else {
                    let (name, o) = &results[0];
                    let mut v = outcome_json(o);
                    v["name"] = serde_json::json!(name);
                    v
                };
                println!("{document}");
            }
            ExitCode::from(status)
        }
    }
}

fn outcome_json(outcome: &Outcome) -> serde_json::Value {
    serde_json::json!({
        "complete": outcome.complete,
        "unique_states": outcome.unique_states,
        "states": outcome.states,
        "max_depth": outcome.max_depth,
        "secs": outcome.secs,
        "violations": outcome.violations,
        "witnessed": outcome.witnessed,
        "not_witnessed": outcome.not_witnessed,
        "missing_witnesses": outcome.missing_witnesses,
    })
}
