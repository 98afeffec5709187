//! `callreg inspect [--json] FILE...`: validate envelopes (specs/design.md §3.1)
//! and show their header, PYTHON_SERIALIZED descriptor and hashid (§3.2),
//! and the metadata side-car `FILE.json` when one exists next to the
//! envelope (`specs/metadata.md`).

use callreg::descriptor::{Digest, PythonSerialized};
use callreg::envelope::Envelope;
use callreg::metadata::CallableMetadata;
use serde::Serialize;

use super::{report, write_stdout, CliError, EXIT_INVALID, EXIT_OK};

/// Arguments of `callreg inspect`.
#[derive(Debug, clap::Args)]
#[command(after_help = "\
A file that cannot be read gets a row too (error ReadError), and a JSON object with --json.

Exit status:
  0  every file is a valid envelope (and every side-car valid metadata)
  1  a file is not a valid envelope, cannot be read, or has an invalid side-car
  2  usage error, or stdout cannot be written")]
pub struct Args {
    /// One JSON object per line per file instead of a table.
    #[arg(long)]
    json: bool,
    /// SPYC envelope files (`-` = stdin).
    #[arg(value_name = "FILE", required = true)]
    files: Vec<String>,
}

/// What `--json` prints for a valid envelope (field order is the output order).
#[derive(Serialize)]
struct ValidReport<'a> {
    file: &'a str,
    valid: bool,
    version: u8,
    serializer: u8,
    /// Declared payload size in bytes.
    payload_size: u64,
    /// Staged bytes read, including header and trailing slack.
    staged_size: usize,
    /// Lowercase hex SHA-256 of the payload, no prefix.
    payload_sha256: String,
    /// The 52 canonical descriptor bytes in lowercase hex.
    descriptor_hex: String,
    hashid: String,
    /// The side-car's metadata (its JSON form), when `FILE.json` exists
    /// and is valid.
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata: Option<&'a CallableMetadata>,
    /// Why `FILE.json` is not valid metadata (`at PATH: REASON`).
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata_error: Option<&'a str>,
}

/// What `--json` prints for an invalid envelope.
#[derive(Serialize)]
struct InvalidReport<'a> {
    file: &'a str,
    valid: bool,
    /// The `EnvelopeError` variant name, e.g. `BadMagic`.
    error: &'static str,
    message: String,
    /// As in [`ValidReport`].
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata: Option<&'a CallableMetadata>,
    /// As in [`ValidReport`].
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata_error: Option<&'a str>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What `--json` prints for a file that cannot be read.
#[derive(Serialize)]
struct UnreadableReport<'a> {
    file: &'a str,
    valid: bool,
    /// Always `ReadError`.
    error: &'static str,
    /// `cannot read FILE: REASON`.
    message: &'a str,
}

/// The `error` of a file that cannot be read (table and `--json`).
const READ_ERROR: &str = "ReadError";

/// One file's outcome.
enum Row {
    Valid(ValidFields),
    Invalid {
        error: &'static str,
        message: String,
    },
    /// The file could not be opened or read.
    Unreadable {
        message: String,
    },
}

struct ValidFields {
    version: u8,
    serializer: u8,
    payload_size: u64,
    staged_size: usize,
    payload_sha256: Digest,
    descriptor: [u8; 52],
    hashid: String,
}

fn inspect_bytes(staged: &[u8]) -> Row {
    match Envelope::parse(staged) {
        Ok(env) => {
            let desc = PythonSerialized::from_envelope(&env);
            Row::Valid(ValidFields {
                version: env.version(),
                serializer: env.serializer(),
                payload_size: env.payload_size(),
                staged_size: env.staged_size(),
                payload_sha256: desc.payload_sha256,
                descriptor: desc.to_bytes(),
                hashid: desc.digest().to_string(),
            })
        }
        Err(e) => Row::Invalid {
            error: e.variant_name(),
            message: e.to_string(),
        },
    }
}

/// The side-car of one envelope: absent, valid metadata, or why not.
enum Sidecar {
    Absent,
    Valid(Box<CallableMetadata>),
    Invalid(String),
}

impl Sidecar {
    /// Reads `FILE.json` next to the envelope `file` (never for stdin).
    fn read(file: &str) -> Sidecar {
        if file == "-" {
            return Sidecar::Absent;
        }
        let path = callreg::metadata::sidecar_path(std::path::Path::new(file));
        let path = path.display();
        let path_text = path.to_string();
        if !std::path::Path::new(&path_text).exists() {
            return Sidecar::Absent;
        }
        match super::input::read_text(&path_text) {
            Err(why) => Sidecar::Invalid(format!("cannot read {path}: {why}")),
            Ok(text) => match CallableMetadata::from_json(&text) {
                Ok(metadata) => Sidecar::Valid(Box::new(metadata)),
                Err(e) => Sidecar::Invalid(format!("{path}: {e}")),
            },
        }
    }

    fn metadata(&self) -> Option<&CallableMetadata> {
        match self {
            Sidecar::Valid(m) => Some(m),
            _ => None,
        }
    }

    fn error(&self) -> Option<&str> {
        match self {
            Sidecar::Invalid(e) => Some(e),
            _ => None,
        }
    }

    /// The table's line for the side-car, or `None` when there is none.
    fn table_line(&self) -> Option<String> {
        match self {
            Sidecar::Absent => None,
            Sidecar::Invalid(e) => Some(format!("  metadata: invalid: {e}\n")),
            Sidecar::Valid(m) => {
                let python = m.python.as_ref().map_or_else(
                    || "any".to_owned(),
                    |p| format!("{} ({} {})", p.version, p.serializer, p.serializer_version),
                );
                Some(format!(
                    "  metadata: name {:?}, executor {}, python {python}, pip [{}], bash {}, hooks {} before / {} after\n",
                    m.name,
                    m.executor_short_name(),
                    m.deps.pip.packages.join(", "),
                    m.deps.bash.commands.len(),
                    m.call_before.len(),
                    m.call_after.len()
                ))
            }
        }
    }
}

fn json_line(file: &str, row: &Row, sidecar: &Sidecar) -> Result<String, CliError> {
    let text = match row {
        Row::Valid(v) => serde_json::to_string(&ValidReport {
            file,
            valid: true,
            version: v.version,
            serializer: v.serializer,
            payload_size: v.payload_size,
            staged_size: v.staged_size,
            payload_sha256: v.payload_sha256.to_hex(),
            descriptor_hex: hex(&v.descriptor),
            hashid: v.hashid.clone(),
            metadata: sidecar.metadata(),
            metadata_error: sidecar.error(),
        }),
        Row::Invalid { error, message } => serde_json::to_string(&InvalidReport {
            file,
            valid: false,
            error,
            message: message.clone(),
            metadata: sidecar.metadata(),
            metadata_error: sidecar.error(),
        }),
        Row::Unreadable { message } => serde_json::to_string(&UnreadableReport {
            file,
            valid: false,
            error: READ_ERROR,
            message,
        }),
    };
    text.map_err(|e| CliError(format!("cannot format JSON for {file}: {e}")))
}

fn table(rows: &[(&str, Row, Sidecar)]) -> String {
    let width = rows
        .iter()
        .map(|(f, _, _)| f.chars().count())
        .chain(std::iter::once(4))
        .max()
        .unwrap_or(4);
    let mut out = format!(
        "{:<width$}  {:<5}  {:>12}  {:>12}  HASHID / ERROR\n",
        "FILE", "VALID", "PAYLOAD", "STAGED"
    );
    for (file, row, sidecar) in rows {
        let line = match row {
            Row::Valid(v) => format!(
                "{file:<width$}  {:<5}  {:>12}  {:>12}  {}\n",
                "yes", v.payload_size, v.staged_size, v.hashid
            ),
            Row::Invalid { error, message } => format!(
                "{file:<width$}  {:<5}  {:>12}  {:>12}  {error}: {message}\n",
                "no", "-", "-"
            ),
            Row::Unreadable { message } => format!(
                "{file:<width$}  {:<5}  {:>12}  {:>12}  {READ_ERROR}: {message}\n",
                "no", "-", "-"
            ),
        };
        out.push_str(&line);
        if let Some(line) = sidecar.table_line() {
            out.push_str(&line);
        }
    }
    out
}

/// Reads an envelope from `file` (`-` = stdin) as every command does
/// ([`super::input::read_envelope_sized`]): a named file must be a regular
/// file (a FIFO, a device or a directory is refused before anything is
/// read), then the 16-byte SPYC header (specs/design.md §3.1) and, if it is
/// valid, at most its `payload_size` bytes. Returns the bytes read and, for
/// a regular file, its length in bytes (the real staged size, trailing
/// slack included).
///
/// # Errors
/// [`CliError`] naming `file` when it cannot be opened or read, or is not
/// a regular file.
fn read_envelope(file: &str) -> Result<(Vec<u8>, Option<u64>), CliError> {
    super::input::read_envelope_sized(file).map_err(|why| CliError::read_because(file, &why))
}

/// Inspects every file in order, with its side-car `FILE.json` when one
/// exists. A file that cannot be read gets a row too (error `ReadError`;
/// also on stderr). Returns [`EXIT_INVALID`] if any file cannot be read or
/// any envelope or side-car is invalid, else [`EXIT_OK`] (a missing and a
/// malformed envelope are the same kind of mistake).
///
/// # Errors
/// [`CliError`] when stdout cannot be written.
pub fn run(args: &Args) -> Result<u8, CliError> {
    let mut rows: Vec<(&str, Row, Sidecar)> = Vec::with_capacity(args.files.len());
    for file in &args.files {
        let (row, sidecar) = match read_envelope(file) {
            Ok((staged, file_len)) => {
                let mut row = inspect_bytes(&staged);
                if let (Row::Valid(fields), Some(len)) = (&mut row, file_len) {
                    fields.staged_size = usize::try_from(len).unwrap_or(usize::MAX);
                }
                (row, Sidecar::read(file))
            }
            Err(CliError(message)) => {
                report(&message);
                (Row::Unreadable { message }, Sidecar::Absent)
            }
        };
        if args.json {
            // Stream JSON lines so a long list shows progress.
            write_stdout(&(json_line(file, &row, &sidecar)? + "\n"))?;
        }
        rows.push((file, row, sidecar));
    }
    if !args.json {
        write_stdout(&table(&rows))?;
    }
    let any_invalid = rows.iter().any(|(_, r, sidecar)| {
        !matches!(r, Row::Valid(_)) || matches!(sidecar, Sidecar::Invalid(_))
    });
    Ok(if any_invalid { EXIT_INVALID } else { EXIT_OK })
}
