//! The stateright model of the callreg registration protocol
//! (`specs/model.md`).
//!
//! The model drives the library's own state machines
//! ([`callreg::protocol::Parent`] and [`callreg::protocol::Target`]) — there
//! is no second copy of the protocol here — through every interleaving of a
//! client script with FIFO delivery per target, crashes, failed
//! deserializations, corrupted staged payloads and passing deadlines, and
//! checks specs/design.md §4.4's invariants with the library's predicates
//! ([`callreg::protocol::invariants`]).
//!
//! * [`script`] — client scripts (built-in and JSON);
//! * [`configs`] — the named configuration set and what each must witness;
//! * [`model`] — the state, the actions and the [`stateright::Model`];
//! * [`properties`] — what is checked;
//! * [`symmetry`] — the reduction over interchangeable targets;
//! * [`run`] — running the checker and reporting (`callreg-model check`).

#![warn(missing_docs)]

pub mod configs;
pub mod model;
pub mod properties;
pub mod run;
pub mod script;
pub mod symmetry;

pub use model::{Action, ModelConfig, RegistrationModel, State};
pub use run::{check, check_named, Outcome, SearchOptions};
pub use script::Script;
