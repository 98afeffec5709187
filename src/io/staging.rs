//! Staged payloads: envelopes in POSIX shared memory (specs/design.md §4.1, §5).
//!
//! The parent creates one shm object per register operation, named
//! `/callreg-<parent pid>-<seq>-<16 random hex digits>` (the file
//! `/dev/shm/callreg-…` on Linux), with `O_CREAT|O_EXCL` and mode 0600, sized
//! exactly to the envelope. The envelope is copied in and hashed in the same
//! pass. Targets open it read-only and map it ([`StagedView`]); the parent
//! unlinks it as soon as every target in scope has replied or been lost
//! (dropping the [`StagedPayload`]). Names left by a parent that died are
//! removed by [`sweep_stale`] when a Worker starts.

use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::os::fd::OwnedFd;

use memmap2::Mmap;
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use sha2::{Digest as _, Sha256};

use crate::error::ErrorCode;

/// Prefix of every staged payload's shm name (without the leading `/`).
pub const NAME_PREFIX: &str = "callreg-";

/// Where Linux exposes POSIX shm objects as files.
pub const SHM_DIR: &str = "/dev/shm";

/// Bytes copied (and hashed) per step while staging: large enough to
/// amortise the write call, small enough to stay in cache for the hash.
const CHUNK_BYTES: usize = 64 * 1024;

/// A failure to create, open, map or remove a staged payload.
#[derive(Debug, thiserror::Error)]
pub enum StagingError {
    /// An OS call failed.
    #[error("{operation} of staged payload {name} failed: {errno}")]
    Os {
        /// What was attempted (`"shm_open"`, `"ftruncate"`, `"write"`, …).
        operation: &'static str,
        /// The shm name.
        name: String,
        /// The OS error.
        errno: Errno,
    },
    /// The staged object's real size differs from the size the register
    /// control announced (a truncated or replaced segment).
    #[error("staged payload {name} holds {actual} bytes, the control announced {expected}")]
    SizeMismatch {
        /// The shm name.
        name: String,
        /// The size in the register control (bytes).
        expected: u64,
        /// The object's real size (bytes).
        actual: u64,
    },
    /// A name that is not a staged payload name (`/callreg-…`, no other `/`).
    #[error("{0:?} is not a staged payload name")]
    BadName(String),
    /// The hashed range lies outside the bytes to stage.
    #[error("hashed range {start}..{end} is outside the {len} staged bytes")]
    BadRange {
        /// Range start (bytes).
        start: usize,
        /// Range end (bytes).
        end: usize,
        /// Length of the bytes to stage.
        len: usize,
    },
}

impl StagingError {
    /// `ENVELOPE_INVALID` for a size mismatch (the bytes cannot be the
    /// envelope that was staged), `IO_FAILED` otherwise.
    pub fn code(&self) -> ErrorCode {
        match self {
            StagingError::SizeMismatch { .. } => ErrorCode::ENVELOPE_INVALID,
            _ => ErrorCode::IO_FAILED,
        }
    }
}

fn os_error<'a>(operation: &'static str, name: &'a str) -> impl FnOnce(Errno) -> StagingError + 'a {
    move |errno| StagingError::Os {
        operation,
        name: name.to_owned(),
        errno,
    }
}

/// A staged payload owned by the parent: unlinked when dropped (RAII), so an
/// early return or a panic on the parent's IO thread cannot leak it.
#[derive(Debug)]
pub struct StagedPayload {
    name: String,
    size: u64,
}

impl StagedPayload {
    /// Creates `/callreg-<this pid>-<seq>-<random>` holding exactly `bytes`,
    /// and returns it with the SHA-256 of `bytes[hashed]`, computed while
    /// copying (one pass over the bytes).
    ///
    /// `hashed` is the part of the envelope that identifies it: the
    /// serializer payload after the SPYC header (specs/design.md §3.2).
    ///
    /// # Errors
    /// [`StagingError::BadRange`] for a range outside `bytes`;
    /// [`StagingError::Os`] when reading random bytes, `shm_open`,
    /// `ftruncate` or `write` fails (the object is then unlinked).
    pub fn create(
        seq: u64,
        bytes: &[u8],
        hashed: Range<usize>,
    ) -> Result<(StagedPayload, [u8; 32]), StagingError> {
        if hashed.start > hashed.end || hashed.end > bytes.len() {
            return Err(StagingError::BadRange {
                start: hashed.start,
                end: hashed.end,
                len: bytes.len(),
            });
        }
        let name = format!(
            "/{NAME_PREFIX}{}-{seq}-{:016x}",
            std::process::id(),
            random_u64()?
        );
        let fd = nix::sys::mman::shm_open(
            name.as_str(),
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )
        .map_err(os_error("shm_open", &name))?;
        // From here on the object exists: the guard unlinks it on any error.
        let staged = StagedPayload {
            name,
            size: bytes.len() as u64,
        };
        let size = i64::try_from(bytes.len()).map_err(|_| StagingError::Os {
            operation: "ftruncate",
            name: staged.name.clone(),
            errno: Errno::EFBIG,
        })?;
        nix::unistd::ftruncate(&fd, size).map_err(os_error("ftruncate", &staged.name))?;
        let mut file = File::from(fd);
        let mut hasher = Sha256::new();
        let mut offset = 0;
        for chunk in bytes.chunks(CHUNK_BYTES) {
            file.write_all(chunk).map_err(|e| StagingError::Os {
                operation: "write",
                name: staged.name.clone(),
                errno: Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
            })?;
            let chunk_range = offset..offset + chunk.len();
            let start = hashed.start.clamp(chunk_range.start, chunk_range.end);
            let end = hashed.end.clamp(chunk_range.start, chunk_range.end);
            hasher.update(&chunk[start - offset..end - offset]);
            offset += chunk.len();
        }
        Ok((staged, hasher.finalize().into()))
    }

    /// The shm name, with its leading `/` (as carried in a register control).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The staged size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for StagedPayload {
    fn drop(&mut self) {
        // ENOENT only if someone else removed it; nothing else can be done.
        let _ = nix::sys::mman::shm_unlink(self.name.as_str());
    }
}

/// A target's read-only mapping of a staged payload.
#[derive(Debug)]
pub struct StagedView {
    map: Option<Mmap>,
}

impl StagedView {
    /// Opens `name` read-only, checks that its real size is `expected_size`
    /// bytes, and maps it read-only.
    ///
    /// # Errors
    /// [`StagingError::BadName`] for a name outside the `/callreg-` space
    /// (a target never opens anything else); [`StagingError::SizeMismatch`]
    /// when the object's size differs from `expected_size`;
    /// [`StagingError::Os`] when `shm_open`, `fstat` or `mmap` fails (e.g.
    /// `ENOENT` for an object already unlinked).
    pub fn open(name: &str, expected_size: u64) -> Result<StagedView, StagingError> {
        let valid = name
            .strip_prefix('/')
            .is_some_and(|rest| rest.starts_with(NAME_PREFIX) && !rest.contains('/'));
        if !valid {
            return Err(StagingError::BadName(name.to_owned()));
        }
        let fd: OwnedFd = nix::sys::mman::shm_open(name, OFlag::O_RDONLY, Mode::empty())
            .map_err(os_error("shm_open", name))?;
        let file = File::from(fd);
        let actual = file
            .metadata()
            .map_err(|e| StagingError::Os {
                operation: "fstat",
                name: name.to_owned(),
                errno: Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
            })?
            .len();
        if actual != expected_size {
            return Err(StagingError::SizeMismatch {
                name: name.to_owned(),
                expected: expected_size,
                actual,
            });
        }
        if actual == 0 {
            // mmap of zero bytes is EINVAL; an empty view is the same bytes.
            return Ok(StagedView { map: None });
        }
        // The size just checked: without a length `map` would `fstat` the
        // object a second time.
        let len = usize::try_from(actual).map_err(|_| StagingError::Os {
            operation: "mmap",
            name: name.to_owned(),
            errno: Errno::EFBIG,
        })?;
        // SAFETY: the object is mapped read-only and private to this view.
        // The parent never writes it after sending the control (it is
        // written once, before), so the mapped bytes do not change under us;
        // a concurrent truncation by a hostile process would raise SIGBUS,
        // which only that process can cause (mode 0600, same user).
        // MAP_POPULATE: the target reads every byte (digest, then the
        // runtime), so faulting the pages in up front is cheaper.
        let map =
            unsafe { memmap2::MmapOptions::new().len(len).populate().map(&file) }.map_err(|e| {
                StagingError::Os {
                    operation: "mmap",
                    name: name.to_owned(),
                    errno: Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)),
                }
            })?;
        Ok(StagedView { map: Some(map) })
    }

    /// The mapped bytes (exactly the staged size).
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}

/// 64 random bits from the kernel (`getrandom(2)`), for staged names that
/// another process cannot predict.
fn random_u64() -> Result<u64, StagingError> {
    let mut buf = [0u8; 8];
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `buf`.
        let n =
            unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        if n < 0 {
            let errno = Errno::last();
            if errno == Errno::EINTR {
                continue;
            }
            return Err(StagingError::Os {
                operation: "getrandom",
                name: String::new(),
                errno,
            });
        }
        filled += n as usize;
    }
    Ok(u64::from_le_bytes(buf))
}

/// The parent pid embedded in a staged name (`callreg-<pid>-…`, without
/// the leading `/`), or `None` for a name of another shape.
pub fn parent_pid_of(file_name: &str) -> Option<i32> {
    let rest = file_name.strip_prefix(NAME_PREFIX)?;
    let (pid, _) = rest.split_once('-')?;
    pid.parse().ok().filter(|pid| *pid > 0)
}

/// Staged names in [`SHM_DIR`] created by this process (`callreg-<own pid>-…`),
/// as file names; used by tests and [`sweep_stale`]'s callers to check that
/// nothing leaked.
///
/// # Errors
/// The IO error of reading the directory.
pub fn own_names() -> std::io::Result<Vec<String>> {
    let own = i32::try_from(std::process::id()).ok();
    Ok(list_names()?
        .into_iter()
        .filter(|n| parent_pid_of(n) == own)
        .collect())
}

fn list_names() -> std::io::Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(SHM_DIR)? {
        if let Some(name) = entry?.file_name().to_str() {
            if name.starts_with(NAME_PREFIX) {
                names.push(name.to_owned());
            }
        }
    }
    names.sort();
    Ok(names)
}

/// Removes every `callreg-<pid>-…` object in [`SHM_DIR`] whose pid names no
/// live process (staged payloads of a parent that crashed); returns the
/// names removed, sorted.
///
/// A name whose pid is alive (this process, another Worker, or an unrelated
/// process that reused the pid) is kept: removing a live parent's staging
/// would fail its operation.
///
/// # Errors
/// The IO error of reading the directory; a name that disappears meanwhile
/// (another sweeper) is not an error.
pub fn sweep_stale() -> std::io::Result<Vec<String>> {
    let mut removed = Vec::new();
    for name in list_names()? {
        let Some(pid) = parent_pid_of(&name) else {
            continue;
        };
        let dead = matches!(
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
            Err(Errno::ESRCH)
        );
        if dead && nix::sys::mman::shm_unlink(format!("/{name}").as_str()).is_ok() {
            removed.push(name);
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn path_of(staged: &StagedPayload) -> String {
        format!("{SHM_DIR}{}", staged.name())
    }

    #[test]
    fn create_sizes_exactly_hashes_the_range_and_unlinks_on_drop() {
        let bytes: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let (staged, hash) = StagedPayload::create(7, &bytes, 16..bytes.len()).unwrap();
        let expected: [u8; 32] = Sha256::digest(&bytes[16..]).into();
        assert_eq!(hash, expected);
        let prefix = format!("/callreg-{}-7-", std::process::id());
        assert!(staged.name().starts_with(&prefix), "{}", staged.name());
        assert_eq!(staged.name().len(), prefix.len() + 16);
        let meta = std::fs::metadata(path_of(&staged)).unwrap();
        assert_eq!(meta.len(), 200_000);
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let view = StagedView::open(staged.name(), 200_000).unwrap();
        assert_eq!(view.bytes(), &bytes[..]);
        let path = path_of(&staged);
        drop(staged);
        assert!(!std::path::Path::new(&path).exists());
        // The view outlives the name: the mapping stays valid.
        assert_eq!(view.bytes()[1000], bytes[1000]);
    }

    #[test]
    fn empty_range_and_empty_bytes() {
        let (staged, hash) = StagedPayload::create(1, b"", 0..0).unwrap();
        let expected: [u8; 32] = Sha256::digest(b"").into();
        assert_eq!(hash, expected);
        assert_eq!(StagedView::open(staged.name(), 0).unwrap().bytes(), b"");
    }

    #[test]
    fn bad_range_is_refused_before_anything_is_created() {
        let err = StagedPayload::create(1, b"abc", 2..4).unwrap_err();
        assert!(matches!(
            err,
            StagingError::BadRange {
                start: 2,
                end: 4,
                len: 3
            }
        ));
    }

    #[test]
    fn open_checks_size_and_name() {
        let (staged, _) = StagedPayload::create(2, b"0123456789", 0..10).unwrap();
        let err = StagedView::open(staged.name(), 11).unwrap_err();
        assert!(matches!(
            err,
            StagingError::SizeMismatch {
                expected: 11,
                actual: 10,
                ..
            }
        ));
        assert_eq!(err.code(), ErrorCode::ENVELOPE_INVALID);
        assert!(matches!(
            StagedView::open("/other", 1),
            Err(StagingError::BadName(_))
        ));
        assert!(matches!(
            StagedView::open("/callreg-1/x", 1),
            Err(StagingError::BadName(_))
        ));
        let name = staged.name().to_owned();
        drop(staged);
        let err = StagedView::open(&name, 10).unwrap_err();
        assert!(matches!(
            err,
            StagingError::Os {
                operation: "shm_open",
                errno: Errno::ENOENT,
                ..
            }
        ));
        assert_eq!(err.code(), ErrorCode::IO_FAILED);
    }

    #[test]
    fn parent_pid_parsing() {
        assert_eq!(parent_pid_of("callreg-123-4-00ff"), Some(123));
        assert_eq!(parent_pid_of("callreg-0-4-00ff"), None);
        assert_eq!(parent_pid_of("callreg-x-4"), None);
        assert_eq!(parent_pid_of("other-123-4"), None);
    }

    #[test]
    fn sweep_removes_dead_parents_names_only() {
        // A pid that certainly belonged to a process that is now reaped.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let dead_name = format!("callreg-{dead}-1-sweeptest");
        let fd = nix::sys::mman::shm_open(
            format!("/{dead_name}").as_str(),
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )
        .unwrap();
        drop(fd);
        let (live, _) = StagedPayload::create(3, b"x", 0..1).unwrap();
        let removed = sweep_stale().unwrap();
        assert!(removed.contains(&dead_name), "{removed:?}");
        assert!(!std::path::Path::new(&format!("{SHM_DIR}/{dead_name}")).exists());
        assert!(std::path::Path::new(&path_of(&live)).exists());
    }
}
