//! Bounded input for the commands: an envelope is read header first, then
//! at most the payload size it declares; a named file must be a regular
//! file (a FIFO, a device such as `/dev/zero` or a directory is refused
//! before anything is read, so nothing blocks or grows without bound); a
//! text input (a plan, a metadata file) is read up to a limit; `-` reads
//! stdin. A closed stdin reads as empty (the Rust runtime opens
//! `/dev/null` in its place at start), so an envelope read from a stdin
//! that gave no byte at all is a read error, not an invalid envelope.

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use callreg::envelope::{Envelope, EnvelopeError, HEADER_LEN};

/// The largest plan or metadata file a command reads, in bytes (16 MiB).
pub const MAX_TEXT_BYTES: u64 = 16 << 20;

/// What a non-regular file is, for the refusal's message.
fn kind_of(file_type: std::fs::FileType) -> &'static str {
    if file_type.is_dir() {
        "a directory"
    } else if file_type.is_fifo() {
        "a FIFO"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_block_device() {
        "a block device"
    } else if file_type.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// An opened input: stdin, or a regular file with its length in bytes.
pub enum Input {
    /// Standard input (`-`).
    Stdin(io::Stdin),
    /// A regular file and its length.
    File(File, u64),
}

impl Read for Input {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Input::Stdin(stdin) => stdin.read(buf),
            Input::File(file, _) => file.read(buf),
        }
    }
}

/// Opens `arg` for reading: `-` is stdin, anything else must be a regular
/// file. A FIFO is opened without blocking, so one with no writer is
/// refused at once.
///
/// # Errors
/// The reason (without the argument): the OS error, or `not a regular
/// file (a FIFO)` and the like.
pub fn open(arg: impl AsRef<Path>) -> Result<Input, String> {
    let arg = arg.as_ref();
    if arg == Path::new("-") {
        return Ok(Input::Stdin(io::stdin()));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(arg)
        .map_err(|e| reason(&e))?;
    let metadata = file.metadata().map_err(|e| reason(&e))?;
    if !metadata.file_type().is_file() {
        return Err(format!(
            "not a regular file ({})",
            kind_of(metadata.file_type())
        ));
    }
    Ok(Input::File(file, metadata.len()))
}

/// The OS reason without the " (os error N)" suffix.
pub fn reason(e: &io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error") {
        Some(i) => text[..i].to_owned(),
        None => text,
    }
}

/// Reads an envelope from `arg` without reading past what it declares:
/// the 16-byte header, then, if the header is valid, at most its
/// `payload_size` bytes (bytes after them are not read). A bad header
/// costs 16 bytes of memory; an input shorter than it declares is returned
/// as read (its parse then fails with `PayloadTruncated`).
///
/// # Errors
/// As [`open`]; a read failure's reason; `no input (stdin is closed or
/// empty)` when stdin gave no byte.
pub fn read_envelope(arg: impl AsRef<Path>) -> Result<Vec<u8>, String> {
    read_envelope_sized(arg).map(|(staged, _)| staged)
}

/// As [`read_envelope`], with the input's length in bytes when it is a
/// regular file (its real staged size, trailing bytes included; `None` for
/// stdin).
///
/// # Errors
/// As [`read_envelope`].
pub fn read_envelope_sized(arg: impl AsRef<Path>) -> Result<(Vec<u8>, Option<u64>), String> {
    let mut input = open(arg)?;
    let file_len = match &input {
        Input::File(_, len) => Some(*len),
        Input::Stdin(_) => None,
    };
    let mut staged = Vec::with_capacity(HEADER_LEN);
    (&mut input)
        .take(HEADER_LEN as u64)
        .read_to_end(&mut staged)
        .map_err(|e| reason(&e))?;
    if staged.is_empty() && matches!(input, Input::Stdin(_)) {
        return Err("no input (stdin is closed or empty)".to_owned());
    }
    if let Err(EnvelopeError::PayloadTruncated { payload_size, .. }) = Envelope::parse(&staged) {
        // A regular file cannot hold more than its length.
        let bound = match &input {
            Input::File(_, len) => payload_size.min(len.saturating_sub(HEADER_LEN as u64)),
            Input::Stdin(_) => payload_size,
        };
        // Grown as the bytes arrive, not reserved from the declared size.
        input
            .take(bound)
            .read_to_end(&mut staged)
            .map_err(|e| reason(&e))?;
    }
    Ok((staged, file_len))
}

/// Reads a whole input of any size (stdin or a regular file).
///
/// # Errors
/// As [`open`], and a read failure's reason.
pub fn read_all(arg: impl AsRef<Path>) -> Result<Vec<u8>, String> {
    let mut input = open(arg)?;
    let mut bytes = Vec::new();
    input.read_to_end(&mut bytes).map_err(|e| reason(&e))?;
    Ok(bytes)
}

/// Reads an input of at most [`MAX_TEXT_BYTES`] (a plan, a metadata
/// file).
///
/// # Errors
/// As [`open`]; `larger than the limit of 16777216 bytes`; a read
/// failure's reason.
pub fn read_limited(arg: impl AsRef<Path>) -> Result<Vec<u8>, String> {
    let mut input = open(arg)?;
    let mut bytes = Vec::new();
    (&mut input)
        .take(MAX_TEXT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| reason(&e))?;
    if bytes.len() as u64 > MAX_TEXT_BYTES {
        return Err(format!("larger than the limit of {MAX_TEXT_BYTES} bytes"));
    }
    Ok(bytes)
}

/// Reads a UTF-8 text input of at most [`MAX_TEXT_BYTES`].
///
/// # Errors
/// As [`read_limited`]; `stream did not contain valid UTF-8`.
pub fn read_text(arg: impl AsRef<Path>) -> Result<String, String> {
    String::from_utf8(read_limited(arg)?)
        .map_err(|_| "stream did not contain valid UTF-8".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_regular_files_are_refused_before_any_read() {
        assert_eq!(
            read_envelope("/dev/zero").map(|_| ()),
            Err("not a regular file (a character device)".to_owned())
        );
        assert_eq!(
            read_text("/").map(|_| ()),
            Err("not a regular file (a directory)".to_owned())
        );
        assert_eq!(
            read_all("/no/such/file").map(|_| ()),
            Err("No such file or directory".to_owned())
        );
    }
}
