//! Making certificates: trust anchors, per-cluster issuers, and workload leaves.
//! One implementation, used by `strait identity`, the issuer service and tests.

use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CustomExtension, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, PublicKeyData, SanType,
    SerialNumber,
};
use ring::rand::SecureRandom;
use rustls::pki_types::{CertificateDer, UnixTime};
use time::OffsetDateTime;

use super::SpiffeId;
use super::certs::{self, CertError};

/// A certificate and its private key, both PEM.
#[derive(Clone)]
pub struct PemPair {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for PemPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("PemPair")
            .field("cert_pem", &self.cert_pem)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error(transparent)]
    Cert(#[from] CertError),
    #[error("cannot make the certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("validity {0:?} is too short: give at least one minute")]
    TooShort(Duration),
    #[error("installing the new certificate: {0}")]
    Slot(String),
    #[error(
        "{id} is outside this issuer's trust domain {trust_domain}: it may only certify spiffe://{trust_domain}/…"
    )]
    OutsideTrustDomain { id: String, trust_domain: String },
    #[error("issuer certificate: {0}")]
    Constraints(String),
}

/// OID of the X.509 NameConstraints extension.
const NAME_CONSTRAINTS_OID: &[u64] = &[2, 5, 29, 30];

/// DER of a NameConstraints extension permitting only URIs whose host is
/// `trust_domain` (RFC 5280 §4.2.1.10; a SPIFFE ID's host is its trust domain).
pub fn trust_domain_constraint(trust_domain: &str) -> Vec<u8> {
    use yasna::Tag;
    yasna::construct_der(|w| {
        w.write_sequence(|w| {
            // permittedSubtrees [0] IMPLICIT GeneralSubtrees
            w.next().write_tagged_implicit(Tag::context(0), |w| {
                w.write_sequence(|w| {
                    // GeneralSubtree { base: uniformResourceIdentifier [6] IMPLICIT IA5String }
                    w.next().write_sequence(|w| {
                        w.next().write_tagged_implicit(Tag::context(6), |w| {
                            w.write_ia5_string(trust_domain)
                        });
                    });
                });
            });
        });
    })
}

fn random_serial() -> SerialNumber {
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .expect("the system RNG works");
    bytes[0] &= 0x7f; // positive INTEGER
    SerialNumber::from_slice(&bytes)
}

fn window(now: OffsetDateTime, validity: Duration) -> (OffsetDateTime, OffsetDateTime) {
    // Back-date a little: clocks of peers differ by seconds, not minutes.
    (now - time::Duration::minutes(1), now + validity)
}

fn ca_params(
    common_name: &str,
    now: OffsetDateTime,
    validity: Duration,
    path_len: Option<u8>,
) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn.push(DnType::OrganizationName, "Strait");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(match path_len {
        Some(n) => BasicConstraints::Constrained(n),
        None => BasicConstraints::Unconstrained,
    });
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.serial_number = Some(random_serial());
    params.use_authority_key_identifier_extension = true;
    (params.not_before, params.not_after) = window(now, validity);
    params
}

/// A new self-signed trust anchor (root CA), ECDSA P-256.
pub fn new_trust_anchor(common_name: &str, validity: Duration) -> Result<PemPair, CaError> {
    if validity < Duration::from_secs(60) {
        return Err(CaError::TooShort(validity));
    }
    let key = KeyPair::generate()?;
    let params = ca_params(common_name, OffsetDateTime::now_utc(), validity, Some(1));
    let cert = params.self_signed(&key)?;
    Ok(PemPair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// A new issuer (intermediate CA) for one cluster, signed by the anchor. The
/// anchor is checked first: it must be a valid CA whose key matches. With a
/// trust domain, the issuer is name-constrained to it (critical extension):
/// verifiers refuse any leaf it signs for another trust domain.
pub fn new_issuer(
    anchor: &PemPair,
    cluster: &str,
    trust_domain: Option<&str>,
    validity: Duration,
) -> Result<PemPair, CaError> {
    if validity < Duration::from_secs(60) {
        return Err(CaError::TooShort(validity));
    }
    let anchor_certs = certs::parse_certs("trust anchor", anchor.cert_pem.as_bytes())?;
    // The anchor must be able to act as an issuer of its own (CA, key, validity, self-signed).
    certs::validate_issuer(
        "trust anchor",
        &anchor_certs[0],
        &anchor.key_pem,
        &anchor_certs[..1],
        UnixTime::now(),
    )?;
    let anchor_key = KeyPair::from_pem(&anchor.key_pem)?;
    let anchor_issuer = Issuer::from_ca_cert_pem(&anchor.cert_pem, anchor_key)?;
    let key = KeyPair::generate()?;
    let mut params = ca_params(
        &format!("strait issuer {cluster}"),
        OffsetDateTime::now_utc(),
        validity,
        Some(0),
    );
    if let Some(td) = trust_domain {
        // Checked as a SPIFFE trust domain before it goes into a certificate.
        SpiffeId::new(td, "ns", "sa").map_err(|e| CaError::Constraints(e.to_string()))?;
        let mut ext =
            CustomExtension::from_oid_content(NAME_CONSTRAINTS_OID, trust_domain_constraint(td));
        ext.set_criticality(true);
        params.custom_extensions.push(ext);
    }
    let cert = params.signed_by(&key, &anchor_issuer)?;
    Ok(PemPair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Signs workload certificates. Holds the issuer key; checked on load.
pub struct LeafSigner {
    issuer: CertifiedIssuerPem,
    not_after: OffsetDateTime,
    constraints: super::trust::Constraints,
}

struct CertifiedIssuerPem {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

impl std::fmt::Debug for LeafSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeafSigner")
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

impl LeafSigner {
    /// Loads an issuer, refusing one that is not a CA, whose key does not match,
    /// that is expired or not yet valid, or that no anchor in `anchors_pem` signed.
    pub fn load(issuer: &PemPair, anchors_pem: &str) -> Result<Self, CaError> {
        let anchors = certs::parse_certs("trust-anchor bundle", anchors_pem.as_bytes())?;
        let chain = certs::parse_certs("issuer certificate", issuer.cert_pem.as_bytes())?;
        certs::validate_issuer(
            "issuer certificate",
            &chain[0],
            &issuer.key_pem,
            &anchors,
            UnixTime::now(),
        )?;
        let info = certs::inspect("issuer certificate", &chain[0])?;
        let constraints =
            super::trust::Constraints::of_issuer(&chain[0]).map_err(CaError::Constraints)?;
        let key = KeyPair::from_pem(&issuer.key_pem)?;
        let not_after = OffsetDateTime::from_unix_timestamp(info.not_after_unix)
            .unwrap_or(OffsetDateTime::UNIX_EPOCH);
        Ok(Self {
            issuer: CertifiedIssuerPem {
                issuer: Issuer::from_ca_cert_pem(&issuer.cert_pem, key)?,
                cert_pem: issuer.cert_pem.clone(),
            },
            not_after,
            constraints,
        })
    }

    /// The one trust domain this issuer is constrained to, if any.
    pub fn trust_domain(&self) -> Option<&str> {
        self.constraints.trust_domain()
    }

    /// PEM of the issuer certificate, sent with every leaf as its chain.
    pub fn issuer_pem(&self) -> &str {
        &self.issuer.cert_pem
    }

    /// Signs `public_key` for `id`, valid for `validity` but never past the
    /// issuer's own expiry. The only SAN is the SPIFFE ID.
    pub fn sign(
        &self,
        public_key: &impl PublicKeyData,
        id: &SpiffeId,
        validity: Duration,
    ) -> Result<SignedLeaf, CaError> {
        self.sign_with(public_key, id, validity, &[])
    }

    /// As [`LeafSigner::sign`], with extra DNS names (for servers that clients
    /// reach by name, like the issuer itself).
    pub fn sign_with(
        &self,
        public_key: &impl PublicKeyData,
        id: &SpiffeId,
        validity: Duration,
        dns_names: &[String],
    ) -> Result<SignedLeaf, CaError> {
        // Never sign what every verifier would refuse.
        if !self.constraints.permits(&id.to_string()) {
            return Err(CaError::OutsideTrustDomain {
                id: id.to_string(),
                trust_domain: self.constraints.describe(),
            });
        }
        let now = OffsetDateTime::now_utc();
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.subject_alt_names = vec![SanType::URI(id.to_string().try_into()?)];
        for name in dns_names {
            params
                .subject_alt_names
                .push(SanType::DnsName(name.clone().try_into()?));
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.serial_number = Some(random_serial());
        params.use_authority_key_identifier_extension = true;
        let (not_before, not_after) = window(now, validity);
        params.not_before = not_before;
        params.not_after = not_after.min(self.not_after);
        let cert = params.signed_by(public_key, &self.issuer.issuer)?;
        Ok(SignedLeaf {
            der: cert.der().clone(),
            pem: cert.pem(),
            not_after: params.not_after.unix_timestamp(),
        })
    }
}

impl LeafSigner {
    /// A new key pair and its leaf for `id`, installed in a fresh [`CertSlot`]
    /// with the issuer as chain. For components given a fixed identity (tests,
    /// the local demo); workloads in a cluster use the issuer service instead.
    pub fn new_identity(
        &self,
        id: &SpiffeId,
        validity: Duration,
    ) -> Result<std::sync::Arc<super::tls::CertSlot>, CaError> {
        let key = KeyPair::generate()?;
        let leaf = self.sign(&key, id, validity)?;
        let mut chain = vec![leaf.der];
        chain.extend(certs::parse_certs(
            "issuer certificate",
            self.issuer_pem().as_bytes(),
        )?);
        let slot = super::tls::CertSlot::new();
        slot.install(chain, &key.serialize_pem())
            .map_err(|e| CaError::Slot(e.to_string()))?;
        Ok(slot)
    }
}

/// A freshly signed leaf certificate.
#[derive(Clone, Debug)]
pub struct SignedLeaf {
    pub der: CertificateDer<'static>,
    pub pem: String,
    /// Expiry, seconds since the Unix epoch.
    pub not_after: i64,
}

/// Makes an anchor plus its issuer in one go; for tests and the local demo.
/// The issuer is constrained to `trust_domain` when one is given.
pub fn new_anchor_and_issuer(
    cluster: &str,
    trust_domain: Option<&str>,
    validity: Duration,
) -> Result<(PemPair, PemPair), CaError> {
    let anchor = new_trust_anchor("strait trust anchor", validity * 2)?;
    let issuer = new_issuer(&anchor, cluster, trust_domain, validity)?;
    Ok((anchor, issuer))
}
