//! Fuzz the wire frame decoder (oracle: `callreg::fuzzing::wire`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    callreg::fuzzing::wire(data);
});
