//! `callreg pack --payload RAW -o OUT.spyc [--sidecar]`: wrap raw serializer
//! bytes in a version-1 cloudpickle SPYC envelope (specs/design.md §3.1),
//! print its hashid, and optionally write its metadata side-car
//! `OUT.spyc.json` (`specs/metadata.md` §2) with the interpreter and
//! cloudpickle versions, so targets can refuse a version mismatch before
//! unpickling.

use std::io::Write;
use std::process::Command;

use callreg::descriptor::python_serialized_digest;
use callreg::envelope::{encode, Envelope, MAGIC};
use callreg::metadata::{
    sidecar_path, CallableMetadata, PythonVersions, DEFAULT_EXECUTOR, SERIALIZER_CLOUDPICKLE,
};

use super::{read_input, write_stdout, CliError, EXIT_OK};

/// Arguments of `callreg pack`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
Prints the envelope's hashid on stdout (on stderr when the envelope goes to stdout).

Exit status:
  0  the envelope (and side-car) were written
  2  usage error, the payload cannot be read or is empty, it already is a
     SPYC envelope (without --force), the versions cannot be detected, or an
     output cannot be written")]
pub struct Args {
    /// Raw serializer payload, e.g. `cloudpickle.dumps(fn)` bytes (`-` = stdin).
    #[arg(long, value_name = "RAW")]
    payload: String,
    /// Where to write the envelope (`-` = stdout). An existing file is replaced.
    #[arg(short = 'o', long = "output", value_name = "OUT.spyc")]
    output: String,
    /// Wrap the payload even if it already is a SPYC envelope.
    #[arg(long)]
    force: bool,
    /// Also write the metadata side-car OUT.spyc.json (name, interpreter and
    /// cloudpickle versions, executor). Not with `-o -`.
    #[arg(long)]
    sidecar: bool,
    /// The callable's name in the side-car [default: OUT without `.spyc`].
    #[arg(long, value_name = "NAME", requires = "sidecar")]
    name: Option<String>,
    /// The interpreter that made the payload, run to detect the versions not
    /// given below [default: python3].
    #[arg(long, value_name = "PATH", requires = "sidecar")]
    python: Option<String>,
    /// The Python version that made the payload, e.g. 3.11.7 [default:
    /// detected].
    #[arg(long, value_name = "VERSION", requires = "sidecar")]
    python_version: Option<String>,
    /// The cloudpickle version that made the payload, e.g. 3.1.1 [default:
    /// detected].
    #[arg(long, value_name = "VERSION", requires = "sidecar")]
    cloudpickle_version: Option<String>,
}

/// Writes `16-byte header + payload` to the output and prints the hashid;
/// with `--sidecar`, writes the side-car too.
///
/// # Errors
/// [`CliError`] when the payload cannot be read, already is an envelope
/// (unless `--force`), the side-car cannot be made, or an output cannot be
/// written.
pub fn run(args: &Args) -> Result<u8, CliError> {
    let payload = read_input(&args.payload)?;
    if payload.is_empty() {
        // No serializer's output is empty: an envelope of nothing would
        // only fail later, in every target.
        let source = if args.payload == "-" {
            "<stdin>"
        } else {
            args.payload.as_str()
        };
        return Err(CliError(format!(
            "{source} is empty: there is no payload to wrap (a serializer's output is never empty)"
        )));
    }
    if !args.force && payload.starts_with(&MAGIC) {
        let what = match Envelope::parse(&payload) {
            Ok(envelope) => format!(
                "a SPYC envelope ({})",
                python_serialized_digest(&envelope).hashid()
            ),
            Err(e) => format!("the start of a SPYC envelope ({})", e.variant_name()),
        };
        return Err(CliError(format!(
            "{} already is {what}, not raw serializer bytes; wrapping it again would hide the \
             callable inside a second envelope (use --force to do it anyway)",
            args.payload
        )));
    }
    let sidecar = if args.sidecar {
        if args.output == "-" {
            return Err(CliError(
                "--sidecar needs an output file (-o OUT.spyc), not stdout".to_owned(),
            ));
        }
        Some(sidecar_metadata(args)?)
    } else {
        None
    };
    let envelope = encode(&payload);
    let hashid = match Envelope::parse(&envelope) {
        Ok(parsed) => python_serialized_digest(&parsed).hashid(),
        Err(e) => return Err(CliError(format!("internal error: {e}"))),
    };
    if args.output == "-" {
        let mut out = std::io::stdout().lock();
        out.write_all(&envelope)
            .and_then(|()| out.flush())
            .map_err(|e| CliError::write("<stdout>", &e))?;
        // stdout holds the envelope: the hashid goes to stderr.
        let _ = writeln!(std::io::stderr().lock(), "{hashid}");
    } else {
        std::fs::write(&args.output, &envelope).map_err(|e| CliError::write(&args.output, &e))?;
        if let Some(metadata) = sidecar {
            let path = sidecar_path(std::path::Path::new(&args.output));
            let shown = path.display().to_string();
            std::fs::write(&path, metadata.to_json_pretty() + "\n")
                .map_err(|e| CliError::write(&shown, &e))?;
        }
        write_stdout(&format!("{hashid}\n"))?;
    }
    Ok(EXIT_OK)
}

/// The side-car's metadata: the name, the versions given or detected, the
/// default executor; checked like any metadata document.
fn sidecar_metadata(args: &Args) -> Result<CallableMetadata, CliError> {
    let (python_version, cloudpickle_version) =
        match (&args.python_version, &args.cloudpickle_version) {
            (Some(python), Some(cloudpickle)) => (python.clone(), cloudpickle.clone()),
            (python, cloudpickle) => {
                let (detected_python, detected_cloudpickle) = detect_versions(args)?;
                (
                    python.clone().unwrap_or(detected_python),
                    cloudpickle.clone().unwrap_or(detected_cloudpickle),
                )
            }
        };
    let name = args.name.clone().unwrap_or_else(|| {
        let file = std::path::Path::new(&args.output)
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        file.strip_suffix(".spyc").unwrap_or(&file).to_owned()
    });
    let mut metadata = CallableMetadata::named(&name);
    metadata.python = Some(PythonVersions::new(
        &python_version,
        SERIALIZER_CLOUDPICKLE,
        &cloudpickle_version,
    ));
    metadata.executor = Some(DEFAULT_EXECUTOR.to_owned());
    metadata
        .validate_at("")
        .map_err(|e| CliError(format!("the side-car would not be valid metadata: {e}")))?;
    Ok(metadata)
}

/// Runs the interpreter to read its version and its cloudpickle's.
fn detect_versions(args: &Args) -> Result<(String, String), CliError> {
    let python = args.python.as_deref().unwrap_or("python3");
    let output = Command::new(python)
        .args([
            "-c",
            "import platform, cloudpickle; print(platform.python_version()); print(cloudpickle.__version__)",
        ])
        .output()
        .map_err(|e| {
            CliError(format!(
                "cannot run {python} to detect the versions: {} (give --python-version and \
                 --cloudpickle-version)",
                super::input::reason(&e)
            ))
        })?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut lines = stdout.lines();
    match (output.status.success(), lines.next(), lines.next()) {
        (true, Some(python_version), Some(cloudpickle_version)) => {
            Ok((python_version.to_owned(), cloudpickle_version.to_owned()))
        }
        _ => Err(CliError(format!(
            "{python} could not report its version and cloudpickle's ({}): {} (give \
             --python-version and --cloudpickle-version)",
            output.status,
            String::from_utf8_lossy(&output.stderr)
                .lines()
                .last()
                .unwrap_or("no output")
        ))),
    }
}
