use std::time::Duration;

use rcgen::{
    CertificateParams, ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, UnixTime};

use super::*;
use crate::identity::ca::{self, PemPair};

const DAY: Duration = Duration::from_secs(86_400);

fn id(s: &str) -> SpiffeId {
    s.parse().unwrap()
}

fn der(pem: &str) -> CertificateDer<'static> {
    certs::parse_certs("test", pem.as_bytes())
        .unwrap()
        .remove(0)
}

/// Signs a leaf for any URI with `issuer`'s key, bypassing `LeafSigner`'s own
/// check: what a thief holding the issuer key could do.
fn forge(issuer: &PemPair, uri: &str, not_after_days: i64) -> CertificateDer<'static> {
    let key = KeyPair::from_pem(&issuer.key_pem).unwrap();
    let signer = Issuer::from_ca_cert_pem(&issuer.cert_pem, key).unwrap();
    let mut params = CertificateParams::default();
    params.subject_alt_names = vec![SanType::URI(uri.to_string().try_into().unwrap())];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(2);
    params.not_after = now + time::Duration::days(not_after_days);
    let leaf_key = KeyPair::generate().unwrap();
    params.signed_by(&leaf_key, &signer).unwrap().der().clone()
}

fn verify(
    bundle: &TrustBundle,
    leaf: &CertificateDer<'_>,
    issuer: &PemPair,
) -> Result<SpiffeId, Refusal> {
    bundle
        .verify(
            leaf,
            &[der(&issuer.cert_pem)],
            UnixTime::now(),
            webpki::KeyUsage::client_auth(),
        )
        .map(|(id, _)| id)
}

#[test]
fn the_constraint_extension_reads_back_as_one_uri_subtree() {
    let anchor = ca::new_trust_anchor("a", DAY).unwrap();
    let issuer = ca::new_issuer(&anchor, "east", Some("east.clusterset.local"), DAY).unwrap();
    let cert = der(&issuer.cert_pem);
    let constraints = Constraints::of_issuer(&cert).unwrap();
    assert_eq!(constraints.trust_domain(), Some("east.clusterset.local"));
    let parsed = X509Certificate::from_der(&cert).unwrap().1;
    assert!(parsed.name_constraints().unwrap().unwrap().critical);
}

#[test]
fn uri_hosts_and_subtrees_follow_rfc_5280() {
    assert_eq!(uri_host("spiffe://east.cs/ns/a/sa/b"), Some("east.cs"));
    assert_eq!(uri_host("https://u@h.example:8443/x"), Some("h.example"));
    assert_eq!(uri_host("spiffe:///ns/a"), None);
    assert_eq!(uri_host("no-scheme"), None);
    let exact = UriConstraint {
        permitted: Some(vec!["east.cs".into()]),
        excluded: vec![],
    };
    assert!(exact.permits_host("east.cs"));
    assert!(exact.permits_host("EAST.cs"));
    assert!(!exact.permits_host("west.cs"));
    assert!(!exact.permits_host("x.east.cs"));
    let domain = UriConstraint {
        permitted: Some(vec![".cs".into()]),
        excluded: vec!["west.cs".into()],
    };
    assert!(domain.permits_host("east.cs"));
    assert!(!domain.permits_host("west.cs"));
    assert!(!domain.permits_host("cs"));
    // Two levels: both must permit.
    let both = Constraints {
        levels: vec![domain, exact],
    };
    assert!(both.permits("spiffe://east.cs/ns/a/sa/b"));
    assert!(!both.permits("spiffe://other.cs/ns/a/sa/b"));
    assert!(!both.permits("not a uri"));
    assert!(Constraints::default().permits("not a uri"));
}

#[test]
fn a_leaked_west_issuer_cannot_mint_east_identities() {
    let anchor = ca::new_trust_anchor("a", DAY * 2).unwrap();
    let east = ca::new_issuer(&anchor, "east", Some("east.cs"), DAY).unwrap();
    let west = ca::new_issuer(&anchor, "west", Some("west.cs"), DAY).unwrap();
    let bundle = TrustBundle::from_pem(anchor.cert_pem.as_bytes()).unwrap();

    let good = forge(&east, "spiffe://east.cs/ns/shop/sa/client", 1);
    assert_eq!(
        verify(&bundle, &good, &east).unwrap(),
        id("spiffe://east.cs/ns/shop/sa/client")
    );

    let stolen = forge(&west, "spiffe://east.cs/ns/shop/sa/client", 1);
    let refusal = verify(&bundle, &stolen, &west).unwrap_err();
    assert_eq!(refusal.reason(), "name-constraint", "{refusal}");
    assert!(refusal.to_string().contains("west.cs"), "{refusal}");

    // The issuer service itself refuses to sign outside its domain.
    let signer = ca::LeafSigner::load(&west, &anchor.cert_pem).unwrap();
    assert_eq!(signer.trust_domain(), Some("west.cs"));
    let err = signer
        .sign(
            &KeyPair::generate().unwrap(),
            &id("spiffe://east.cs/ns/a/sa/b"),
            DAY,
        )
        .unwrap_err();
    assert!(
        matches!(err, ca::CaError::OutsideTrustDomain { .. }),
        "{err}"
    );
}

#[test]
fn unconstrained_issuers_keep_working_for_any_trust_domain() {
    let anchor = ca::new_trust_anchor("a", DAY * 2).unwrap();
    let legacy = ca::new_issuer(&anchor, "east", None, DAY).unwrap();
    let bundle = TrustBundle::from_pem(anchor.cert_pem.as_bytes()).unwrap();
    let leaf = forge(&legacy, "spiffe://cluster.local/ns/a/sa/b", 1);
    assert_eq!(
        verify(&bundle, &leaf, &legacy).unwrap(),
        id("spiffe://cluster.local/ns/a/sa/b")
    );
    // A leaf straight under the anchor is accepted too.
    let direct = forge(&anchor, "spiffe://cluster.local/ns/a/sa/b", 1);
    let (got, root) = bundle
        .verify(
            &direct,
            &[],
            UnixTime::now(),
            webpki::KeyUsage::server_auth(),
        )
        .unwrap();
    assert_eq!((got, root), (id("spiffe://cluster.local/ns/a/sa/b"), 0));
}

#[test]
fn foreign_expired_and_idless_peers_are_refused_with_their_reason() {
    let anchor = ca::new_trust_anchor("a", DAY * 2).unwrap();
    let issuer = ca::new_issuer(&anchor, "east", Some("east.cs"), DAY).unwrap();
    let bundle = TrustBundle::from_pem(anchor.cert_pem.as_bytes()).unwrap();

    let foreign_anchor = ca::new_trust_anchor("a", DAY * 2).unwrap();
    let foreign = ca::new_issuer(&foreign_anchor, "east", Some("east.cs"), DAY).unwrap();
    let leaf = forge(&foreign, "spiffe://east.cs/ns/a/sa/b", 1);
    assert_eq!(
        verify(&bundle, &leaf, &foreign).unwrap_err().reason(),
        "unknown-anchor"
    );
    // The foreign issuer's leaf presented with our issuer as intermediate: bad signature.
    assert!(verify(&bundle, &leaf, &issuer).is_err());

    let expired = forge(&issuer, "spiffe://east.cs/ns/a/sa/b", -1);
    assert_eq!(
        verify(&bundle, &expired, &issuer).unwrap_err().reason(),
        "expired"
    );

    let not_spiffe = forge(&issuer, "https://east.cs/x", 1);
    assert_eq!(
        verify(&bundle, &not_spiffe, &issuer).unwrap_err().reason(),
        "no-spiffe-id"
    );

    // Three-deep chains are not Strait's.
    let leaf = forge(&issuer, "spiffe://east.cs/ns/a/sa/b", 1);
    let err = bundle
        .verify(
            &leaf,
            &[der(&issuer.cert_pem), der(&foreign.cert_pem)],
            UnixTime::now(),
            webpki::KeyUsage::client_auth(),
        )
        .unwrap_err();
    assert_eq!(err.reason(), "bad-chain");
}

#[test]
fn an_issuer_with_constraints_strait_does_not_evaluate_is_refused() {
    let anchor = ca::new_trust_anchor("a", DAY * 2).unwrap();
    let key = KeyPair::from_pem(&anchor.key_pem).unwrap();
    let signer = Issuer::from_ca_cert_pem(&anchor.cert_pem, key).unwrap();
    let mut params = CertificateParams::default();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.name_constraints = Some(rcgen::NameConstraints {
        permitted_subtrees: vec![rcgen::GeneralSubtree::DnsName("example.com".into())],
        excluded_subtrees: vec![],
    });
    let issuer_key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&issuer_key, &signer).unwrap();
    let issuer = PemPair {
        cert_pem: cert.pem(),
        key_pem: issuer_key.serialize_pem(),
    };
    let bundle = TrustBundle::from_pem(anchor.cert_pem.as_bytes()).unwrap();
    let leaf = forge(&issuer, "spiffe://east.cs/ns/a/sa/b", 1);
    let err = verify(&bundle, &leaf, &issuer).unwrap_err();
    assert_eq!(err.reason(), "bad-chain");
    assert!(err.to_string().contains("does not evaluate"), "{err}");
}

#[test]
fn a_replaced_bundle_is_seen_by_every_clone_and_names_its_active_anchor() {
    let old = ca::new_trust_anchor("old", DAY * 2).unwrap();
    let new = ca::new_trust_anchor("new", DAY * 2).unwrap();
    let old_issuer = ca::new_issuer(&old, "east", Some("east.cs"), DAY).unwrap();
    let new_issuer = ca::new_issuer(&new, "east", Some("east.cs"), DAY).unwrap();
    let bundle = TrustBundle::from_pem(old.cert_pem.as_bytes()).unwrap();
    let clone = bundle.clone();
    let leaf_new = forge(&new_issuer, "spiffe://east.cs/ns/a/sa/b", 1);
    assert_eq!(
        verify(&clone, &leaf_new, &new_issuer).unwrap_err().reason(),
        "unknown-anchor"
    );

    let both = format!("{}{}", old.cert_pem, new.cert_pem);
    assert!(bundle.replace_from_pem(both.as_bytes()).unwrap());
    assert!(
        !bundle.replace_from_pem(both.as_bytes()).unwrap(),
        "same text: no change"
    );
    assert!(verify(&clone, &leaf_new, &new_issuer).is_ok());
    let chain_new = [leaf_new.clone(), der(&new_issuer.cert_pem)];
    let leaf_old = forge(&old_issuer, "spiffe://east.cs/ns/a/sa/b", 1);
    let chain_old = [leaf_old, der(&old_issuer.cert_pem)];
    assert!(clone.chains_to_active(&chain_old));
    assert!(!clone.chains_to_active(&chain_new));

    let rotated = format!("{}{}", new.cert_pem, old.cert_pem);
    bundle.replace_from_pem(rotated.as_bytes()).unwrap();
    assert!(clone.chains_to_active(&chain_new));
    assert_eq!(clone.fingerprints()[0], fingerprint(&der(&new.cert_pem)));
    assert!(
        bundle.replace_from_pem(b"not pem").is_err(),
        "a bad bundle is refused"
    );
    assert_eq!(clone.len(), 2, "and the last good one kept");
}
