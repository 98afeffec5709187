//! Test support shared by the `protocol_*` integration tests.

pub mod sim;
