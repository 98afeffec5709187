//! # callreg
//!
//! Registers serialized Python callables (SPYC envelopes of cloudpickle
//! bytes) from a parent worker process into its forked child workers
//! ("targets") by content identity (hashid), and dispatches tasks to them.
//!
//! Layers, each a module (a module never imports from a layer above it):
//!
//! * ids — [`ids`]: the target, seq, operation, staging, owner and
//!   namespace ids and the machines' time, which every layer names;
//! * formats — [`envelope`] (SPYC, specs/design.md §3.1) and [`descriptor`]
//!   (canonical descriptors, digests and hashids, specs/design.md §3.2);
//! * plain data as JSON — [`json`] (strict decoding naming the field) and
//!   [`metadata`] (callable metadata: versions, executor, deps, hooks;
//!   specs/design.md §6, `specs/metadata.md`);
//! * the pure protocol — [`error`] and [`protocol`] (specs/design.md §4): state
//!   machines with no IO, no clock reads, no randomness and no threads.
//!
//! The default build holds only these; the IO layer and Python targets are
//! behind the `io` and `python` cargo features.
//!
//! # Embedding Python targets (feature `python`)
//!
//! The build links the shared libpython of the interpreter named by
//! `PYO3_PYTHON` (an absolute path; best a virtual environment's
//! `bin/python` with cloudpickle installed), and the targets start that
//! interpreter's configuration, its site-packages included
//! ([`runtime::python::BUILD_PYTHON`]). The dynamic loader must then find
//! that same libpython when the program runs. callreg's own binaries carry
//! its directory as their RUNPATH; a program that depends on callreg adds it
//! in its own build script, from what callreg publishes (`links = "callreg"`)
//! as `DEP_CALLREG_PYTHON_LIBDIR`:
//!
//! ```text
//! // build.rs of a crate with `callreg = { version = "…", features = ["python"] }`
//! fn main() {
//!     println!("cargo:rerun-if-env-changed=DEP_CALLREG_PYTHON_LIBDIR");
//!     if let Ok(dir) = std::env::var("DEP_CALLREG_PYTHON_LIBDIR") {
//!         if !dir.is_empty() {
//!             println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
//!         }
//!     }
//! }
//! ```
//!
//! (`DEP_CALLREG_PYTHON` names the interpreter; `tests/dependent/` is a
//! complete such crate, built and run by the tests.) Without it the loader
//! may pick another libpython of the same minor version, such as the
//! system's, whose site-packages lack cloudpickle: the targets then refuse
//! to start (`TARGET_LOST`, kind `LibpythonMismatch`, naming the library
//! loaded and the directory the build expected; the target writes it to
//! stderr) instead of failing later with `ModuleNotFoundError`.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod descriptor;
pub mod envelope;
pub mod error;
pub mod ids;
pub mod json;
pub mod metadata;
pub mod protocol;
pub mod wire;

#[cfg(feature = "io")]
pub mod io;
#[cfg(feature = "io")]
pub mod runtime;
#[cfg(feature = "io")]
pub mod sync;

#[doc(hidden)]
pub mod fuzzing;

/// The README's Rust snippets, compiled and run by `cargo test --doc`.
#[cfg(all(doctest, feature = "io"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The Rust snippets of the documentation site's page on the library and
/// the IO layer, compiled and run by `cargo test --doc`.
#[cfg(all(doctest, feature = "io"))]
#[doc = include_str!("../docs/rust.md")]
pub struct RustGuideDoctests;
