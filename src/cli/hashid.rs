//! `callreg hashid FILE`: print only the hashid of one envelope.

use callreg::descriptor::python_serialized_digest;
use callreg::envelope::Envelope;

use super::{input, report, shown, write_stdout, CliError, EXIT_INVALID, EXIT_OK};

/// Arguments of `callreg hashid`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Exit status:
  0  the hashid was printed
  1  the file is not a valid envelope or cannot be read
  2  usage error, or stdout cannot be written")]
pub struct Args {
    /// The SPYC envelope file (`-` = stdin).
    #[arg(value_name = "FILE")]
    file: String,
}

/// Prints `sha256:<hex>` of the envelope's PYTHON_SERIALIZED descriptor.
/// Returns [`EXIT_INVALID`] (with the error on stderr) for an invalid
/// envelope or a file that cannot be read. Reads the 16-byte header
/// first, then at most the payload size it declares
/// ([`input::read_envelope`]); a file that is not a regular file (a FIFO,
/// a device) or a closed stdin cannot be read.
///
/// # Errors
/// [`CliError`] when stdout cannot be written.
pub fn run(args: &Args) -> Result<u8, CliError> {
    // A file that cannot be read is an input that is not a valid envelope:
    // the same status as a malformed one.
    let staged = match input::read_envelope(&args.file) {
        Ok(staged) => staged,
        Err(why) => {
            report(&CliError::read_because(shown(&args.file), &why).0);
            return Ok(EXIT_INVALID);
        }
    };
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
