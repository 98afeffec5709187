//! The stateright model of the callreg registration protocol (see `specs/model.md`).
