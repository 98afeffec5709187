//! Property tests of the SPYC envelope (specs/design.md §3.1): encode → parse
//! round trip, arbitrary bytes never panic, and each single corrupted header
//! field yields its own `EnvelopeError` variant.

use callreg::descriptor::{python_serialized_digest, Digest, PythonSerialized};
use callreg::envelope::{
    encode, encode_into, encode_out_of_band, header_of, Envelope, EnvelopeError, BUFFER_ALIGN,
    HEADER_LEN, VERSION_OUT_OF_BAND,
};
use proptest::prelude::*;

proptest! {
    #[test]
    fn encode_parse_round_trip(
        payload in proptest::collection::vec(any::<u8>(), 0..4096),
        slack in 0usize..64,
    ) {
        let mut staged = encode(&payload);
        prop_assert_eq!(staged.len(), HEADER_LEN + payload.len());
        staged.resize(staged.len() + slack, 0);
        let env = Envelope::parse(&staged).unwrap();
        prop_assert_eq!(env.payload(), &payload[..]);
        prop_assert_eq!(env.payload_size(), payload.len() as u64);
        prop_assert_eq!(env.staged_size(), staged.len());
        prop_assert_eq!(
            python_serialized_digest(&env),
            PythonSerialized {
                payload_format_version: 1,
                serializer_id: 1,
                payload_sha256: Digest::sha256(&payload),
            }
            .digest()
        );
        let mut buf = vec![0u8; HEADER_LEN + payload.len() + slack];
        prop_assert_eq!(encode_into(&payload, &mut buf), Ok(HEADER_LEN + payload.len()));
        prop_assert_eq!(&buf[..], &staged[..]);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        match Envelope::parse(&bytes) {
            Ok(env) => prop_assert!(env.encoded_len() <= bytes.len()),
            Err(EnvelopeError::HeaderTruncated { staged_size }) => {
                prop_assert!(bytes.len() < HEADER_LEN);
                prop_assert_eq!(staged_size, bytes.len());
            }
            Err(_) => prop_assert!(bytes.len() >= HEADER_LEN),
        }
    }

    /// The out-of-band form (specs/formats.md §1.1) gives back its pickle
    /// and buffers, each at an aligned offset, whatever their sizes.
    #[test]
    fn out_of_band_round_trip(
        pickle in proptest::collection::vec(any::<u8>(), 0..5000),
        buffers in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..9000), 0..4),
        slack in 0usize..64,
    ) {
        let refs: Vec<&[u8]> = buffers.iter().map(Vec::as_slice).collect();
        let mut staged = encode_out_of_band(&pickle, &refs);
        staged.resize(staged.len() + slack, 0);
        let env = Envelope::parse(&staged).unwrap();
        prop_assert_eq!(env.version(), VERSION_OUT_OF_BAND);
        prop_assert_eq!(env.pickle(), &pickle[..]);
        let got: Vec<(u64, &[u8])> = env.buffers().collect();
        prop_assert_eq!(got.len(), buffers.len());
        for ((offset, bytes), want) in got.iter().zip(&buffers) {
            prop_assert_eq!(offset % BUFFER_ALIGN, 0);
            prop_assert_eq!(*bytes, &want[..]);
        }
        prop_assert_eq!(env.encoded_len(), staged.len() - slack);
    }

    /// Arbitrary payloads of the out-of-band form never panic the parser,
    /// and what it accepts lies inside the payload.
    #[test]
    fn arbitrary_out_of_band_payload_never_panics(
        payload in proptest::collection::vec(any::<u8>(), 0..256),
        tail in proptest::collection::vec(any::<u64>(), 0..6),
    ) {
        let mut body = payload;
        for value in tail {
            body.extend_from_slice(&(value % 8192).to_le_bytes());
        }
        let mut staged = header_of(VERSION_OUT_OF_BAND, body.len() as u64).to_vec();
        staged.extend_from_slice(&body);
        if let Ok(env) = Envelope::parse(&staged) {
            prop_assert!(env.pickle().len() <= body.len());
            for (offset, bytes) in env.buffers() {
                prop_assert_eq!(offset % BUFFER_ALIGN, 0);
                prop_assert!(offset as usize + bytes.len() <= staged.len());
            }
        }
    }

    /// Arbitrary bytes behind a valid magic reach the later checks.
    #[test]
    fn arbitrary_header_after_magic_never_panics(
        rest in proptest::collection::vec(any::<u8>(), 12..128),
    ) {
        let mut bytes = b"SPYC".to_vec();
        bytes.extend_from_slice(&rest);
        let _ = Envelope::parse(&bytes).map(|e| python_serialized_digest(&e));
    }

    #[test]
    fn corrupted_magic_is_bad_magic(
        payload in proptest::collection::vec(any::<u8>(), 0..64),
        magic in any::<[u8; 4]>().prop_filter("not SPYC", |m| m != b"SPYC"),
    ) {
        let mut b = encode(&payload);
        b[0..4].copy_from_slice(&magic);
        prop_assert_eq!(Envelope::parse(&b), Err(EnvelopeError::BadMagic { found: magic }));
    }

    #[test]
    fn corrupted_version_is_unsupported_version(
        payload in proptest::collection::vec(any::<u8>(), 0..64),
        version in any::<u8>().prop_filter("not 1 or 129", |v| *v != 1 && *v != 129),
    ) {
        let mut b = encode(&payload);
        b[4] = version;
        prop_assert_eq!(Envelope::parse(&b), Err(EnvelopeError::UnsupportedVersion { found: version }));
    }

    #[test]
    fn corrupted_serializer_is_unsupported_serializer(
        payload in proptest::collection::vec(any::<u8>(), 0..64),
        serializer in any::<u8>().prop_filter("not 1", |v| *v != 1),
    ) {
        let mut b = encode(&payload);
        b[5] = serializer;
        prop_assert_eq!(
            Envelope::parse(&b),
            Err(EnvelopeError::UnsupportedSerializer { found: serializer })
        );
    }

    #[test]
    fn corrupted_flags_are_non_zero_flags(
        payload in proptest::collection::vec(any::<u8>(), 0..64),
        flags in 1u16..,
    ) {
        let mut b = encode(&payload);
        b[6..8].copy_from_slice(&flags.to_le_bytes());
        prop_assert_eq!(Envelope::parse(&b), Err(EnvelopeError::NonZeroFlags { found: flags }));
    }

    #[test]
    fn oversized_payload_size_is_payload_truncated(
        payload in proptest::collection::vec(any::<u8>(), 0..64),
        excess in 1u64..,
    ) {
        let mut b = encode(&payload);
        let declared = (payload.len() as u64).saturating_add(excess);
        b[8..16].copy_from_slice(&declared.to_le_bytes());
        prop_assert_eq!(
            Envelope::parse(&b),
            Err(EnvelopeError::PayloadTruncated {
                payload_size: declared,
                available: payload.len() as u64,
            })
        );
    }

    #[test]
    fn truncated_header_is_header_truncated(len in 0usize..HEADER_LEN) {
        let b = encode(b"payload");
        prop_assert_eq!(
            Envelope::parse(&b[..len]),
            Err(EnvelopeError::HeaderTruncated { staged_size: len })
        );
    }
}
