//! Fuzzes everything the issuer does with request bytes before authentication.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rcgen::PublicKeyData;
use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::protocol::{
    CertificateRequest, MAX_REQUEST_BYTES, RequestError, parse_request,
};

fuzz_target!(|data: &[u8]| {
    match parse_request(data) {
        Ok(parsed) => {
            assert!(data.len() <= MAX_REQUEST_BYTES);
            // The body is the documented JSON, and it round-trips: encoded
            // again, it parses to the same pod and the same (verified) key.
            let request: CertificateRequest =
                serde_json::from_slice(data).expect("an accepted body is a CertificateRequest");
            assert_eq!(request.pod, parsed.pod);
            let encoded = serde_json::to_vec(&request).expect("serializable");
            let again = parse_request(&encoded).expect("re-encoded request parses");
            assert_eq!(again.pod, parsed.pod);
            assert_eq!(
                again.csr.public_key.der_bytes(),
                parsed.csr.public_key.der_bytes()
            );
            assert_eq!(
                again.csr.public_key.algorithm(),
                parsed.csr.public_key.algorithm()
            );
            // A pod reference is a Kubernetes namespace and name: it goes into
            // a TokenReview-backed lookup and a SPIFFE ID.
            if let Some(pod) = &parsed.pod {
                assert!(
                    SpiffeId::new("x", &pod.namespace, &pod.name).is_ok(),
                    "{pod:?}"
                );
            }
            // Past the limit the same request is refused unread.
            let mut padded = data.to_vec();
            padded.resize(MAX_REQUEST_BYTES + 1, b' ');
            assert_eq!(
                parse_request(&padded).unwrap_err(),
                RequestError::TooLarge(MAX_REQUEST_BYTES + 1)
            );
        }
        Err(e) => {
            // Every refusal has a stable reason and a message.
            assert!(matches!(
                e.reason(),
                "request_too_large" | "bad_request" | "bad_csr" | "bad_pod_ref"
            ));
            assert!(!e.to_string().is_empty());
            assert_eq!(
                matches!(e, RequestError::TooLarge(_)),
                data.len() > MAX_REQUEST_BYTES
            );
        }
    }
});
