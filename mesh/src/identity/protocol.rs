//! The issuer's wire format. Proxies and gateways `POST /v1/certificates` over
//! HTTPS with `Authorization: Bearer <projected ServiceAccount token>` and a JSON
//! body; the issuer answers with the signed leaf and its chain.
//!
//! [`parse_request`] is everything the issuer does with untrusted bytes before
//! authentication, so it is bounded, total (never panics) and fuzzed
//! (`fuzz/fuzz_targets/issuer_request.rs`).

use rcgen::CertificateSigningRequestParams;
use rustls::pki_types::CertificateSigningRequestDer;
use rustls::pki_types::pem::PemObject;
use serde::{Deserialize, Serialize};

use super::SpiffeId;

/// Path of the signing endpoint.
pub const CERTIFICATES_PATH: &str = "/v1/certificates";
/// Largest request body the issuer reads.
pub const MAX_REQUEST_BYTES: usize = 16 * 1024;

/// A request for a certificate.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CertificateRequest {
    /// PKCS#10 CSR, PEM. Only its public key is used: the issuer decides every name.
    pub csr: String,
    /// Ask for the identity of this pod instead of the caller's own. Only a node
    /// proxy may, and only for a pod scheduled on its own node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodRef>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
}

/// The issuer's answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CertificateResponse {
    pub identity: SpiffeId,
    /// The leaf, PEM.
    pub certificate: String,
    /// Issuer certificate(s), PEM, leaf's parent first.
    pub chain: String,
    /// Expiry of the leaf, seconds since the Unix epoch.
    pub expires_at: i64,
}

/// An error body; `reason` is a stable word for metrics and clients.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ErrorResponse {
    pub reason: String,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("request body is {0} bytes; the limit is {MAX_REQUEST_BYTES}")]
    TooLarge(usize),
    #[error("request body is not the expected JSON ({{\"csr\": \"<PEM>\", \"pod\": {{…}}}}): {0}")]
    Json(String),
    #[error("csr is not a PEM CERTIFICATE REQUEST: {0}")]
    CsrPem(String),
    #[error("csr cannot be parsed or its signature does not verify: {0}")]
    Csr(String),
    #[error("pod reference names an invalid {0}")]
    PodRef(&'static str),
}

impl RequestError {
    /// Stable reason word for metrics and error bodies.
    pub fn reason(&self) -> &'static str {
        match self {
            RequestError::TooLarge(_) => "request_too_large",
            RequestError::Json(_) => "bad_request",
            RequestError::CsrPem(_) | RequestError::Csr(_) => "bad_csr",
            RequestError::PodRef(_) => "bad_pod_ref",
        }
    }
}

/// A parsed, self-consistent request: the CSR's signature verified (the caller
/// holds the private key), the pod reference well-formed.
#[derive(Debug)]
pub struct ParsedRequest {
    pub csr: CertificateSigningRequestParams,
    pub pod: Option<PodRef>,
}

/// Parses a request body. Never panics; bounded by [`MAX_REQUEST_BYTES`].
pub fn parse_request(body: &[u8]) -> Result<ParsedRequest, RequestError> {
    if body.len() > MAX_REQUEST_BYTES {
        return Err(RequestError::TooLarge(body.len()));
    }
    let request: CertificateRequest =
        serde_json::from_slice(body).map_err(|e| RequestError::Json(e.to_string()))?;
    let der = CertificateSigningRequestDer::from_pem_slice(request.csr.as_bytes())
        .map_err(|e| RequestError::CsrPem(e.to_string()))?;
    let csr = CertificateSigningRequestParams::from_der(&der)
        .map_err(|e| RequestError::Csr(e.to_string()))?;
    if let Some(pod) = &request.pod {
        // Same rules as SPIFFE IDs use for namespaces; pod names are DNS subdomains.
        SpiffeId::new("x", &pod.namespace, "x").map_err(|_| RequestError::PodRef("namespace"))?;
        SpiffeId::new("x", "x", &pod.name).map_err(|_| RequestError::PodRef("pod name"))?;
    }
    Ok(ParsedRequest {
        csr,
        pod: request.pod,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn csr_pem() -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        rcgen::CertificateParams::default()
            .serialize_request(&key)
            .unwrap()
            .pem()
            .unwrap()
    }

    #[test]
    fn accepts_a_well_formed_request() {
        let body = serde_json::to_vec(&CertificateRequest {
            csr: csr_pem(),
            pod: Some(PodRef {
                namespace: "shop".into(),
                name: "web-0".into(),
            }),
        })
        .unwrap();
        let parsed = parse_request(&body).unwrap();
        assert_eq!(parsed.pod.unwrap().name, "web-0");
    }

    #[test]
    fn refuses_bad_input_with_a_reason() {
        let big = vec![b' '; MAX_REQUEST_BYTES + 1];
        assert_eq!(
            parse_request(&big).unwrap_err().reason(),
            "request_too_large"
        );
        assert_eq!(parse_request(b"{").unwrap_err().reason(), "bad_request");
        assert_eq!(
            parse_request(br#"{"csr":"x","extra":1}"#)
                .unwrap_err()
                .reason(),
            "bad_request"
        );
        assert_eq!(
            parse_request(br#"{"csr":"not pem"}"#).unwrap_err().reason(),
            "bad_csr"
        );
        // A CSR whose signature was tampered with.
        let der = CertificateSigningRequestDer::from_pem_slice(csr_pem().as_bytes()).unwrap();
        let mut bytes = der.as_ref().to_vec();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x55;
        use base64::Engine as _;
        let pem = format!(
            "-----BEGIN CERTIFICATE REQUEST-----\n{}\n-----END CERTIFICATE REQUEST-----\n",
            base64::engine::general_purpose::STANDARD.encode(&bytes)
        );
        let body = serde_json::to_vec(&CertificateRequest {
            csr: pem,
            pod: None,
        })
        .unwrap();
        assert_eq!(parse_request(&body).unwrap_err().reason(), "bad_csr");
        // A pod reference that is not a Kubernetes name.
        let body = serde_json::to_vec(&CertificateRequest {
            csr: csr_pem(),
            pod: Some(PodRef {
                namespace: "../etc".into(),
                name: "web".into(),
            }),
        })
        .unwrap();
        assert_eq!(parse_request(&body).unwrap_err().reason(), "bad_pod_ref");
    }
}
