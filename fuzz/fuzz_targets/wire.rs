//! Fuzzes the wire frame decoder (DESIGN.md §3.3): arbitrary bytes never
//! panic, the decoder never asks for more than the maximum frame size, and
//! every frame it accepts re-encodes to exactly the bytes it consumed.
#![no_main]

use callreg::wire::{decode, Decoded, FrameBuffer};
use libfuzzer_sys::fuzz_target;

/// Small, so oversized headers are common in the corpus.
const MAX: usize = 4096;

fuzz_target!(|data: &[u8]| {
    match decode(data, MAX) {
        Ok(Decoded::Frame(frame, used)) => {
            assert!(used <= data.len() && used <= MAX);
            assert_eq!(frame.encode(MAX).as_deref(), Ok(&data[..used]));
        }
        Ok(Decoded::Incomplete(needed)) => assert!(needed > data.len() && needed <= MAX),
        Err(_) => {}
    }
    // The same bytes fed one at a time give the same first outcome.
    let mut buffer = FrameBuffer::new(MAX).expect("MAX is above the minimum");
    let mut first = None;
    for byte in data {
        buffer.extend(std::slice::from_ref(byte));
        match buffer.next_frame() {
            Ok(None) => continue,
            outcome => {
                first = Some(outcome);
                break;
            }
        }
    }
    match (decode(data, MAX), first) {
        (Ok(Decoded::Frame(frame, _)), Some(Ok(Some(got)))) => assert_eq!(frame, got),
        (Err(err), Some(Err(got))) => assert_eq!(err, got),
        (Ok(Decoded::Incomplete(_)), None) => {}
        (expected, got) => panic!("decode gave {expected:?}, the buffer gave {got:?}"),
    }
});
