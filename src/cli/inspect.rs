//! `callreg inspect [--json] FILE...`: validate envelopes (DESIGN.md §3.1)
//! and show their header, PYTHON_SERIALIZED descriptor and hashid (§3.2).

use callreg::descriptor::{Digest, PythonSerialized};
use callreg::envelope::Envelope;
use serde::Serialize;

use super::{read_input, report, write_stdout, CliError, EXIT_INVALID, EXIT_OK, EXIT_USAGE};

/// Arguments of `callreg inspect`.
#[derive(Debug, clap::Args)]
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
}

/// What `--json` prints for an invalid envelope.
#[derive(Serialize)]
struct InvalidReport<'a> {
    file: &'a str,
    valid: bool,
    /// The `EnvelopeError` variant name, e.g. `BadMagic`.
    error: &'static str,
    message: String,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One file's outcome.
enum Row {
    Valid(ValidFields),
    Invalid {
        error: &'static str,
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

fn json_line(file: &str, row: &Row) -> Result<String, CliError> {
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
        }),
        Row::Invalid { error, message } => serde_json::to_string(&InvalidReport {
            file,
            valid: false,
            error,
            message: message.clone(),
        }),
    };
    text.map_err(|e| CliError(format!("cannot format JSON for {file}: {e}")))
}

fn table(rows: &[(&str, Row)]) -> String {
    let width = rows
        .iter()
        .map(|(f, _)| f.chars().count())
        .chain(std::iter::once(4))
        .max()
        .unwrap_or(4);
    let mut out = format!(
        "{:<width$}  {:<5}  {:>12}  {:>12}  HASHID / ERROR\n",
        "FILE", "VALID", "PAYLOAD", "STAGED"
    );
    for (file, row) in rows {
        let line = match row {
            Row::Valid(v) => format!(
                "{file:<width$}  {:<5}  {:>12}  {:>12}  {}\n",
                "yes", v.payload_size, v.staged_size, v.hashid
            ),
            Row::Invalid { error, message } => format!(
                "{file:<width$}  {:<5}  {:>12}  {:>12}  {error}: {message}\n",
                "no", "-", "-"
            ),
        };
        out.push_str(&line);
    }
    out
}

/// Inspects every file in order. Unreadable files are reported on stderr
/// and skipped. Returns [`EXIT_USAGE`] if any file could not be read, else
/// [`EXIT_INVALID`] if any envelope is invalid, else [`EXIT_OK`].
///
/// # Errors
/// [`CliError`] when stdout cannot be written.
pub fn run(args: &Args) -> Result<u8, CliError> {
    let mut rows: Vec<(&str, Row)> = Vec::with_capacity(args.files.len());
    let mut read_failed = false;
    for file in &args.files {
        match read_input(file) {
            Ok(staged) => {
                let row = inspect_bytes(&staged);
                if args.json {
                    // Stream JSON lines so a long list shows progress.
                    write_stdout(&(json_line(file, &row)? + "\n"))?;
                }
                rows.push((file, row));
            }
            Err(CliError(message)) => {
                report(&message);
                read_failed = true;
            }
        }
    }
    if !args.json && !rows.is_empty() {
        write_stdout(&table(&rows))?;
    }
    let any_invalid = rows.iter().any(|(_, r)| matches!(r, Row::Invalid { .. }));
    Ok(if read_failed {
        EXIT_USAGE
    } else if any_invalid {
        EXIT_INVALID
    } else {
        EXIT_OK
    })
}
