//! `callreg hashid FILE`: print only the hashid of one envelope.

use callreg::descriptor::python_serialized_digest;
use callreg::envelope::Envelope;

use super::{input, report, shown, write_stdout, CliError, EXIT_INVALID, EXIT_OK};

/// Arguments of `callreg hashid`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The SPYC envelope file (`-` = stdin).
    #[arg(value_name = "FILE")]
    file: String,
}

/// Prints `sha256:<hex>` of the envelope's PYTHON_SERIALIZED descriptor.
/// Returns [`EXIT_INVALID`] (with the error on stderr) for an invalid
/// envelope. Reads the 16-byte header first, then at most the payload
/// size it declares ([`input::read_envelope`]).
///
/// # Errors
/// [`CliError`] (exit status 2) when the file cannot be read, is not a
/// regular file (a FIFO, a device), stdin is closed, or stdout cannot be
/// written.
pub fn run(args: &Args) -> Result<u8, CliError> {
    let staged = input::read_envelope(&args.file)
        .map_err(|why| CliError::read_because(shown(&args.file), &why))?;
    match Envelope::parse(&staged) {
        Ok(env) => {
            write_stdout(&format!("{}\n", python_serialized_digest(&env)))?;
            Ok(EXIT_OK)
        }
        Err(e) => {
            report(&format!("{}: {} ({})", args.file, e, e.variant_name()));
            Ok(EXIT_INVALID)
        }
    }
}
