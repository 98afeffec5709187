//! Fuzz hashid and `module:qualname` text parsing
//! (oracle: `callreg::fuzzing::hashid`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    callreg::fuzzing::hashid(data);
});
