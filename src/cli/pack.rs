//! `callreg pack --payload RAW -o OUT.spyc`: wrap raw serializer bytes in a
//! version-1 cloudpickle SPYC envelope (specs/design.md §3.1).

use std::io::Write;

use callreg::envelope::encode;

use super::{read_input, CliError, EXIT_OK};

/// Arguments of `callreg pack`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Raw serializer payload, e.g. `cloudpickle.dumps(fn)` bytes (`-` = stdin).
    #[arg(long, value_name = "RAW")]
    payload: String,
    /// Where to write the envelope (`-` = stdout). An existing file is replaced.
    #[arg(short = 'o', long = "output", value_name = "OUT.spyc")]
    output: String,
}

/// Writes `16-byte header + payload` to the output.
///
/// # Errors
/// [`CliError`] when the payload cannot be read or the output written.
pub fn run(args: &Args) -> Result<u8, CliError> {
    let payload = read_input(&args.payload)?;
    let envelope = encode(&payload);
    if args.output == "-" {
        let mut out = std::io::stdout().lock();
        out.write_all(&envelope)
            .and_then(|()| out.flush())
            .map_err(|e| CliError::write("<stdout>", &e))?;
    } else {
        std::fs::write(&args.output, &envelope).map_err(|e| CliError::write(&args.output, &e))?;
    }
    Ok(EXIT_OK)
}
