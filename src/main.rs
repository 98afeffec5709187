//! The `callreg` command: inspect, hash and pack SPYC envelopes
//! (specs/design.md §3), and run plans of registrations and tasks on forked
//! Python targets (`run`, cargo feature `python`). Exit status: 0 success,
//! 1 an input is invalid (for `run`: a step did not meet its expectation),
//! 2 usage, read, write or plan error.

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
