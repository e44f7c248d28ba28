//! Fuzzes what a receiver does with the first bytes of every tunnelled
//! connection, and what a sender does with the receiver's answer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strait_mesh::tunnel::{HeaderError, MAX_HEADER_BYTES, TunnelHeader, TunnelResponse};

/// What every decoder must honour: a message that decodes is bounded, decodes
/// the same from exactly its own bytes, is incomplete one byte short, and
/// re-encodes to something that decodes to the same value, canonically.
macro_rules! check {
    ($ty:ty, $data:expr) => {
        match <$ty>::decode($data) {
            Ok((value, consumed)) => {
                assert!(consumed <= $data.len() && consumed <= MAX_HEADER_BYTES);
                let (again, n) = <$ty>::decode(&$data[..consumed]).expect("own bytes decode");
                assert_eq!((&again, n), (&value, consumed));
                assert!(matches!(
                    <$ty>::decode(&$data[..consumed - 1]),
                    Err(HeaderError::Incomplete { .. })
                ));
                let encoded = value.encode();
                assert!(encoded.len() <= MAX_HEADER_BYTES);
                let (round, n) = <$ty>::decode(&encoded).expect("re-encoded value decodes");
                assert_eq!(round, value);
                assert_eq!(n, encoded.len());
                assert_eq!(round.encode(), encoded, "encoding is canonical");
            }
            Err(e) => {
                // Every refusal has a stable reason and a message.
                assert!(!e.reason().is_empty());
                assert!(!e.to_string().is_empty());
                let _ = TunnelResponse::for_header_error(&e).map(|r| r.encode());
            }
        }
    };
}

fuzz_target!(|data: &[u8]| {
    check!(TunnelHeader, data);
    check!(TunnelResponse, data);
});
