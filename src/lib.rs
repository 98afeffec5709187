//! # callreg
//!
//! Registers serialized Python callables (SPYC envelopes of cloudpickle
//! bytes) from a parent worker process into its forked child workers
//! ("targets") by content identity (hashid), and dispatches tasks to them.
//!
//! Layers, each a module (a module never imports from a layer above it):
//!
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

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod descriptor;
pub mod envelope;
pub mod error;
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
