//! The `callreg` command: inspect, hash and pack SPYC envelopes
//! (DESIGN.md §3). Exit status: 0 success, 1 an input is invalid, 2 usage,
//! read or write error.

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
