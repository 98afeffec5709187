//! Command-line front end. One file per subcommand; [`Command`] lists them.
//!
//! Conventions every subcommand follows: a file argument of `-` means
//! stdin (or stdout for an output); errors are one readable line on stderr
//! naming the argument as the user gave it; no panics, no backtraces.

use std::ffi::OsString;
use std::io::{self, Write};
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod hashid;
mod input;
mod inspect;
mod pack;
#[cfg(feature = "python")]
mod plan;
mod run;

/// Exit status when every input was valid.
pub const EXIT_OK: u8 = 0;
/// Exit status when at least one input is not a valid (or readable)
/// envelope, or a plan step did not go as expected.
pub const EXIT_INVALID: u8 = 1;
/// Exit status on a usage error, a plan that cannot run, or an output that
/// cannot be written.
pub const EXIT_USAGE: u8 = 2;

/// `callreg`: tools for SPYC envelopes of serialized Python callables.
#[derive(Debug, Parser)]
#[command(
    name = "callreg",
    version,
    about,
    long_about = None,
    after_help = "\
Exit status (every command; `callreg COMMAND --help` says what each means there):
  0  success
  1  an input is not what it must be (an invalid or unreadable envelope; a
     plan step that did not go as expected)
  2  usage error (also: a plan that cannot be run)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Validate SPYC envelopes and show their header, descriptor and hashid.
    Inspect(inspect::Args),
    /// Print the hashid of one SPYC envelope.
    Hashid(hashid::Args),
    /// Wrap raw serializer (cloudpickle) bytes in a SPYC envelope and print its hashid.
    Pack(pack::Args),
    /// Run a plan of registrations and tasks on forked Python targets.
    Run(run::Args),
}

/// A failure that ends the command with [`EXIT_USAGE`]: one readable line.
#[derive(Debug)]
pub struct CliError(pub String);

impl CliError {
    /// A read failure of `arg` for the reason `why` (e.g. `not a regular
    /// file (a FIFO)`).
    pub fn read_because(arg: &str, why: &str) -> Self {
        CliError(format!("cannot read {arg}: {why}"))
    }

    /// A write failure of `arg` (the argument as given, never resolved).
    pub fn write(arg: &str, e: &io::Error) -> Self {
        CliError(format!("cannot write {arg}: {}", input::reason(e)))
    }
}

/// Reads a whole input file; `-` reads stdin ([`input::read_all`]: a
/// named file must be a regular file, a closed stdin is a read error).
///
/// # Errors
/// [`CliError`] naming `arg` when the file cannot be opened or read.
pub fn read_input(arg: &str) -> Result<Vec<u8>, CliError> {
    input::read_all(arg).map_err(|why| CliError::read_because(shown(arg), &why))
}

/// How an input argument is named in errors (`<stdin>` for `-`).
fn shown(arg: &str) -> &str {
    if arg == "-" {
        "<stdin>"
    } else {
        arg
    }
}

/// Writes to stdout; a closed pipe (e.g. `| head`) ends output quietly.
pub fn write_stdout(text: &str) -> Result<(), CliError> {
    let mut out = io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(CliError::write("<stdout>", &e)),
    }
}

/// Prints one error line on stderr.
pub fn report(message: &str) {
    // Nothing useful can be done if stderr itself is gone.
    let _ = writeln!(io::stderr().lock(), "callreg: {message}");
}

/// Parses `args` and runs the subcommand; returns the process exit status.
pub fn run<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version go to stdout with status 0; usage errors to
            // stderr with status 2.
            let _ = e.print();
            return if e.use_stderr() { EXIT_USAGE } else { EXIT_OK };
        }
    };
    let result = match cli.command {
        Command::Inspect(a) => inspect::run(&a),
        Command::Hashid(a) => hashid::run(&a),
        Command::Pack(a) => pack::run(&a),
        Command::Run(a) => run::run(&a),
    };
    match result {
        Ok(status) => status,
        Err(CliError(message)) => {
            report(&message);
            EXIT_USAGE
        }
    }
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    ExitCode::from(run(std::env::args_os()))
}
