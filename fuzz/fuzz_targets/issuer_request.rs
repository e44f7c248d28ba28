//! Fuzzes everything the issuer does with request bytes before authentication.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strait_mesh::identity::protocol::{MAX_REQUEST_BYTES, parse_request};

fuzz_target!(|data: &[u8]| {
    match parse_request(data) {
        Ok(parsed) => {
            // A request that parses has a CSR whose signature verified.
            assert!(data.len() <= MAX_REQUEST_BYTES);
            let _ = parsed.pod;
        }
        Err(e) => {
            // Every refusal has a stable reason and a message.
            assert!(!e.reason().is_empty());
            assert!(!e.to_string().is_empty());
        }
    }
});
