//! Reading certificates and keys: PEM parsing, inspection, and the checks an
//! issuer (intermediate CA) must pass before anything signs with it.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

use super::SpiffeId;

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("{what}: no PEM certificate found; expected -----BEGIN CERTIFICATE----- blocks")]
    NoCertificate { what: String },
    #[error("{what}: not valid PEM: {source}")]
    Pem {
        what: String,
        source: rustls::pki_types::pem::Error,
    },
    #[error("{what}: not a valid X.509 certificate: {detail}")]
    X509 { what: String, detail: String },
    #[error("{what}: not a usable private key (PKCS#8, SEC1 or PKCS#1 PEM): {detail}")]
    Key { what: String, detail: String },
    #[error(
        "{what} is not a CA certificate (basicConstraints CA:TRUE with keyCertSign): it cannot sign certificates; make it with `strait identity issuer`"
    )]
    NotCa { what: String },
    #[error(
        "{what}: the private key does not belong to the certificate; pass the key that was generated with it"
    )]
    KeyMismatch { what: String },
    #[error("{what} is not valid yet: valid from {not_before}; check the clock or wait")]
    NotYetValid { what: String, not_before: String },
    #[error("{what} expired at {not_after}; make a new one with `strait identity issuer`")]
    Expired { what: String, not_after: String },
    #[error(
        "{what} was not signed by any certificate in the trust-anchor bundle ({anchors}); make the issuer with the anchor its peers trust"
    )]
    NotSignedByAnchor { what: String, anchors: String },
}

/// All certificates in a PEM text, in order.
pub fn parse_certs(what: &str, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, CertError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| CertError::Pem {
            what: what.to_string(),
            source,
        })?;
    if certs.is_empty() {
        return Err(CertError::NoCertificate {
            what: what.to_string(),
        });
    }
    Ok(certs)
}

/// The first private key in a PEM text.
pub fn parse_key(what: &str, pem: &[u8]) -> Result<PrivateKeyDer<'static>, CertError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| CertError::Key {
        what: what.to_string(),
        detail: e.to_string(),
    })
}

fn x509<'a>(what: &str, der: &'a [u8]) -> Result<X509Certificate<'a>, CertError> {
    X509Certificate::from_der(der)
        .map(|(_, c)| c)
        .map_err(|e| CertError::X509 {
            what: what.to_string(),
            detail: e.to_string(),
        })
}

/// What a person (or `strait identity inspect`) wants to know about a certificate.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CertInfo {
    pub subject: String,
    pub issuer: String,
    pub serial: String,
    pub sans: Vec<String>,
    pub spiffe_id: Option<String>,
    pub not_before: String,
    pub not_after: String,
    /// Seconds since the Unix epoch, for metrics and refresh arithmetic.
    pub not_before_unix: i64,
    pub not_after_unix: i64,
    pub is_ca: bool,
    pub self_signed: bool,
}

/// Inspects one DER certificate.
pub fn inspect(what: &str, der: &[u8]) -> Result<CertInfo, CertError> {
    let cert = x509(what, der)?;
    let mut sans = Vec::new();
    let mut spiffe_id = None;
    if let Ok(Some(ext)) = cert.subject_alternative_name() {
        for name in &ext.value.general_names {
            match name {
                GeneralName::DNSName(d) => sans.push(format!("DNS:{d}")),
                GeneralName::URI(u) => {
                    if u.starts_with("spiffe://") && spiffe_id.is_none() {
                        spiffe_id = Some(u.to_string());
                    }
                    sans.push(format!("URI:{u}"));
                }
                GeneralName::IPAddress(ip) => sans.push(format!("IP:{}", format_ip(ip))),
                other => sans.push(format!("{other:?}")),
            }
        }
    }
    let validity = cert.validity();
    Ok(CertInfo {
        subject: cert.subject().to_string(),
        issuer: cert.issuer().to_string(),
        serial: cert.raw_serial_as_string(),
        sans,
        spiffe_id,
        not_before: validity.not_before.to_string(),
        not_after: validity.not_after.to_string(),
        not_before_unix: validity.not_before.timestamp(),
        not_after_unix: validity.not_after.timestamp(),
        is_ca: cert.is_ca(),
        self_signed: cert.subject() == cert.issuer(),
    })
}

fn format_ip(bytes: &[u8]) -> String {
    match bytes.len() {
        4 => std::net::Ipv4Addr::from(<[u8; 4]>::try_from(bytes).expect("length checked"))
            .to_string(),
        16 => std::net::Ipv6Addr::from(<[u8; 16]>::try_from(bytes).expect("length checked"))
            .to_string(),
        _ => format!("{bytes:02x?}"),
    }
}

/// Every URI SAN of a certificate (none if it cannot be read).
pub fn uri_sans(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        return Vec::new();
    };
    let Ok(Some(ext)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    ext.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::URI(u) => Some(u.to_string()),
            _ => None,
        })
        .collect()
}

/// The issuer's distinguished name of a certificate, for messages.
pub fn issuer_name(der: &[u8]) -> Option<String> {
    X509Certificate::from_der(der)
        .ok()
        .map(|(_, c)| c.issuer().to_string())
}

/// The SPIFFE ID in a certificate's URI SANs; Strait certificates carry exactly one.
pub fn spiffe_id_of(der: &[u8]) -> Option<SpiffeId> {
    let cert = X509Certificate::from_der(der).ok()?.1;
    let ext = cert.subject_alternative_name().ok()??;
    let mut ids = ext.value.general_names.iter().filter_map(|n| match n {
        GeneralName::URI(u) if u.starts_with("spiffe://") => u.parse::<SpiffeId>().ok(),
        _ => None,
    });
    let first = ids.next()?;
    // Two SPIFFE IDs in one certificate is ambiguous: refuse to pick one.
    ids.next().is_none().then_some(first)
}

/// Whether `cert` may sign certificates: a CA, with keyCertSign when it has
/// a key usage at all.
pub fn can_sign(cert: &X509Certificate<'_>) -> bool {
    let key_cert_sign = cert
        .key_usage()
        .ok()
        .flatten()
        .map(|ku| ku.value.key_cert_sign())
        .unwrap_or(true);
    cert.is_ca() && key_cert_sign
}

/// Checks that `cert` (with `key`) can act as an issuer under `anchors` at `now`:
/// a CA, the key matches, currently valid, and signed by one of the anchors.
pub fn validate_issuer(
    what: &str,
    cert_der: &[u8],
    key_pem: &str,
    anchors: &[CertificateDer<'_>],
    now: UnixTime,
) -> Result<(), CertError> {
    let cert = x509(what, cert_der)?;
    if !can_sign(&cert) {
        return Err(CertError::NotCa {
            what: what.to_string(),
        });
    }
    let key = rcgen::KeyPair::from_pem(key_pem).map_err(|e| CertError::Key {
        what: what.to_string(),
        detail: e.to_string(),
    })?;
    if rcgen::PublicKeyData::subject_public_key_info(&key) != cert.public_key().raw {
        return Err(CertError::KeyMismatch {
            what: what.to_string(),
        });
    }
    check_validity(what, &cert, now)?;
    let mut names = Vec::new();
    for (i, anchor_der) in anchors.iter().enumerate() {
        let anchor = x509(&format!("trust anchor #{}", i + 1), anchor_der)?;
        names.push(anchor.subject().to_string());
        if anchor.subject() == cert.issuer()
            && cert.verify_signature(Some(anchor.public_key())).is_ok()
        {
            check_validity("the trust anchor that signed it", &anchor, now)?;
            return Ok(());
        }
    }
    Err(CertError::NotSignedByAnchor {
        what: what.to_string(),
        anchors: names.join("; "),
    })
}

fn check_validity(what: &str, cert: &X509Certificate<'_>, now: UnixTime) -> Result<(), CertError> {
    let now = now.as_secs() as i64;
    let validity = cert.validity();
    if now < validity.not_before.timestamp() {
        return Err(CertError::NotYetValid {
            what: what.to_string(),
            not_before: validity.not_before.to_string(),
        });
    }
    if now > validity.not_after.timestamp() {
        return Err(CertError::Expired {
            what: what.to_string(),
            not_after: validity.not_after.to_string(),
        });
    }
    Ok(())
}
