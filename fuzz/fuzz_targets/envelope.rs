//! Fuzz the SPYC envelope parser and the PYTHON_SERIALIZED digest
//! (oracle: `callreg::fuzzing::envelope`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    callreg::fuzzing::envelope(data);
});
