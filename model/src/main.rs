//! `callreg-model`: checks the callreg registration protocol exhaustively
//! (`check`) or serves stateright's Explorer over it (`explore`). See
//! `specs/model.md`.
//!
//! Exit status of `check`: 0 when the run is complete and no property
//! failed; 1 when a property failed; 2 when the run is incomplete (depth
//! bound); 64 for a bad command line, script or configuration.

use std::process::ExitCode;
use std::time::Duration;

use callreg_model::model::{ModelConfig, RegistrationModel};
use callreg_model::run::{check, Outcome, SearchOptions};
use callreg_model::script::Script;
use clap::{Args, Parser, Subcommand};
use stateright::Model;

#[derive(Parser, Debug)]
#[command(
    name = "callreg-model",
    version,
    args_override_self = true,
    about = "Model-check the callreg registration protocol (the library's own state machines) with faults"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Explore every reachable state and check every property.
    Check {
        #[command(flatten)]
        config: ConfigArgs,
        /// Merge states that differ only by renumbering targets (runs depth first).
        #[arg(long)]
        symmetry: bool,
        /// Search depth first (default: breadth first, shortest counterexamples).
        #[arg(long)]
        dfs: bool,
        /// Checker threads, at least 1 (default: available cores).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        threads: Option<u64>,
        /// Stop below this depth (the run is then reported incomplete).
        #[arg(long)]
        max_depth: Option<usize>,
        /// Stop at the first violation (faster; the run is then incomplete).
        #[arg(long)]
        first: bool,
        /// Seconds between progress lines on stderr.
        #[arg(long, default_value_t = 5)]
        progress_secs: u64,
        /// Print the result as one JSON line at the end of stdout.
        #[arg(long)]
        json: bool,
    },
    /// Serve stateright's Explorer (a web UI over the state space).
    Explore {
        #[command(flatten)]
        config: ConfigArgs,
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:3000")]
        addr: String,
    },
    /// List the built-in scripts and mutants.
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
    /// Switch on a known bug (see `list`); needs the `mutants` feature.
    #[arg(long)]
    mutant: Option<String>,
}

fn load_script(name: &str) -> Result<Script, String> {
    if let Some(script) = Script::named(name) {
        return Ok(script);
    }
    let text = std::fs::read_to_string(name)
        .map_err(|e| format!("{name:?} is neither a built-in script nor a readable file: {e}"))?;
    Script::from_json(&text).map_err(|e| format!("{name}: {e}"))
}

fn model_of(args: &ConfigArgs) -> Result<RegistrationModel, String> {
    #[cfg(feature = "mutants")]
    let mut fence_on_timeout = !args.no_fence;
    #[cfg(not(feature = "mutants"))]
    let fence_on_timeout = !args.no_fence;
    #[cfg(feature = "mutants")]
    if let Some(mutant) = args
        .mutant
        .as_deref()
        .and_then(callreg_model::model::mutant_named)
    {
        // A mutant whose code path fencing never reaches would pass
        // silently: switch fencing off, and say so.
        if callreg_model::model::mutant_needs_no_fence(mutant) {
            if fence_on_timeout {
                eprintln!(
                    "callreg-model: notice: --mutant {} implies --no-fence (a fenced target never leaves a digest uncertain)",
                    callreg_model::model::mutant_name(mutant)
                );
                fence_on_timeout = false;
            }
            if args.deadlines == 0 {
                eprintln!(
                    "callreg-model: warning: --mutant {} cannot be reached with --deadlines 0 (only a passed deadline leaves a digest uncertain)",
                    callreg_model::model::mutant_name(mutant)
                );
            }
        }
    }
    let config = ModelConfig {
        targets: args.targets,
        script: load_script(&args.script)?,
        crashes: args.crashes,
        deserialize_failures: args.deserialize_failures,
        stage_failures: args.stage_failures,
        corruptions: args.corruptions,
        deadlines: args.deadlines,
        tasks: args.tasks,
        fence_on_timeout,
        slot_capacity: args.slots,
        snapshot_failures: args.snapshot_failures.clone(),
        #[cfg(feature = "mutants")]
        mutant: match &args.mutant {
            None => None,
            Some(name) => Some(callreg_model::model::mutant_named(name).ok_or_else(|| {
                format!("unknown mutant {name:?}; `callreg-model list` shows them")
            })?),
        },
    };
    #[cfg(not(feature = "mutants"))]
    if args.mutant.is_some() {
        return Err("--mutant needs callreg-model built with the `mutants` feature".into());
    }
    RegistrationModel::new(config).map_err(|e| e.to_string())
}

fn print_human(outcome: &Outcome) {
    for violation in &outcome.violations {
        println!("VIOLATION of {:?}:", violation.property);
        for (i, line) in violation.trace.iter().enumerate() {
            if line.starts_with("=>") || line.starts_with("   ") {
                println!("  {line}");
            } else {
                println!("  {:>3}. {line}", i + 1);
            }
        }
    }
    for name in &outcome.witnessed {
        println!("witnessed: {name}");
    }
    for name in &outcome.not_witnessed {
        println!("not witnessed in this configuration: {name}");
    }
    println!(
        "{}: {} unique states, {} states, max depth {}, {:.2} s ({:.0} unique states/s); {} violation(s)",
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
        outcome.violations.len()
    );
}

fn main() -> ExitCode {
    // Usage errors exit 64 (specs/model.md §8): 2 means "incomplete" here,
    // so clap's own exit status for a bad command line cannot be used.
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let usage_error = e.use_stderr();
            // Printing to a closed stdout/stderr is not worth a panic.
            let _ = e.print();
            return if usage_error {
                ExitCode::from(64)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    match cli.command {
        Command::List => {
            for script in Script::builtin() {
                println!("script {}: {}", script.name, script.description);
            }
            #[cfg(feature = "mutants")]
            for mutant in callreg::protocol::Mutant::ALL {
                let name = callreg_model::model::mutant_name(*mutant);
                if callreg_model::model::mutant_needs_no_fence(*mutant) {
                    println!("mutant {name} (reachable only with --no-fence and --deadlines 1 or more; --mutant {name} implies --no-fence)");
                } else {
                    println!("mutant {name} (reachable with fencing on or off)");
                }
            }
            ExitCode::SUCCESS
        }
        Command::Explore { config, addr } => {
            let model = match model_of(&config) {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("callreg-model: {e}");
                    return ExitCode::from(64);
                }
            };
            // Stateright's server panics on a bind failure: check first.
            if let Err(e) = std::net::TcpListener::bind(addr.as_str()) {
                eprintln!("callreg-model: cannot listen on {addr}: {e}");
                return ExitCode::from(64);
            }
            eprintln!("serving the Explorer on http://{addr}");
            let checker = model.checker().serve(addr.as_str());
            drop(checker);
            ExitCode::SUCCESS
        }
        Command::Check {
            config,
            symmetry,
            dfs,
            threads,
            max_depth,
            first,
            progress_secs,
            json,
        } => {
            let model = match model_of(&config) {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("callreg-model: {e}");
                    return ExitCode::from(64);
                }
            };
            let threads = threads.map_or_else(
                || std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
                |n| usize::try_from(n).unwrap_or(usize::MAX),
            );
            let options = SearchOptions {
                symmetry,
                dfs,
                threads,
                max_depth,
                progress_every: (progress_secs > 0).then(|| Duration::from_secs(progress_secs)),
                stop_at_first_violation: first,
            };
            let outcome = check(model, &options);
            print_human(&outcome);
            if json {
                let line = serde_json::json!({
                    "complete": outcome.complete,
                    "unique_states": outcome.unique_states,
                    "states": outcome.states,
                    "max_depth": outcome.max_depth,
                    "secs": outcome.secs,
                    "violations": outcome.violations,
                    "witnessed": outcome.witnessed,
                    "not_witnessed": outcome.not_witnessed,
                });
                println!("{line}");
            }
            if !outcome.violations.is_empty() {
                ExitCode::from(1)
            } else if !outcome.complete {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            }
        }
    }
}
