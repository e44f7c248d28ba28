//! What a workload trusts and how every handshake checks a peer: the anchor
//! bundle (one shared handle, swapped whole when the bundle file changes, so
//! TLS configs built once follow a rotation) and the chain verification.
//!
//! A Strait chain is `leaf ← issuer ← anchor` (or `leaf ← anchor`). Issuers are
//! name-constrained to their cluster's trust domain with an X.509
//! NameConstraints URI subtree (RFC 5280 §4.2.1.10: the constraint is the URI's
//! host, which in a SPIFFE ID is the trust domain). rustls-webpki refuses every
//! chain with a URI constraint (it does not evaluate them), so the work is split:
//! - the issuer is checked once and cached: CA with keyCertSign, signed by an
//!   anchor of the bundle (x509-parser's signature check), valid now, and its
//!   constraints read (URI subtrees only; any other form is refused, fail closed);
//! - the leaf is checked by webpki against that issuer as its only anchor
//!   (signature, validity, key usage), with the constraints left to
//! - [`Constraints::permits`]: every URI SAN of the leaf must fall inside every
//!   level's permitted subtrees and outside its excluded ones.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use rustls::RootCertStore;
use rustls::pki_types::{CertificateDer, TrustAnchor, UnixTime};
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

use super::SpiffeId;
use super::certs::{self, CertError};
use super::refusals::RefusalLog;

/// Why a peer's certificate is refused. Each has a bounded metric label.
#[derive(Clone, Debug, thiserror::Error)]
pub enum Refusal {
    #[error(
        "its chain reaches no anchor of this trust bundle (issuer {issuer:?}): the peer belongs to another trust anchor"
    )]
    UnknownAnchor { issuer: String },
    #[error("{what} expired at {at}")]
    Expired { what: &'static str, at: String },
    #[error("{what} is not valid until {at}")]
    NotYetValid { what: &'static str, at: String },
    #[error("{id} is outside what its issuer may certify ({allowed})")]
    NameConstraint { id: String, allowed: String },
    #[error("the certificate carries no (single) SPIFFE ID in its URI SANs")]
    NoSpiffeId,
    #[error("peer is {got}, expected {expected}")]
    WrongIdentity { got: SpiffeId, expected: String },
    #[error("bad chain: {0}")]
    BadChain(String),
}

impl Refusal {
    /// The `reason` label of `tls_refusals_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::UnknownAnchor { .. } => "unknown-anchor",
            Refusal::Expired { .. } => "expired",
            Refusal::NotYetValid { .. } => "not-yet-valid",
            Refusal::NameConstraint { .. } => "name-constraint",
            Refusal::NoSpiffeId => "no-spiffe-id",
            Refusal::WrongIdentity { .. } => "wrong-identity",
            Refusal::BadChain(_) => "bad-chain",
        }
    }

    /// The error rustls reports (and turns into the TLS alert).
    pub fn to_rustls(&self) -> rustls::Error {
        use rustls::CertificateError as C;
        rustls::Error::InvalidCertificate(match self {
            Refusal::UnknownAnchor { .. } => C::UnknownIssuer,
            Refusal::Expired { .. } => C::Expired,
            Refusal::NotYetValid { .. } => C::NotValidYet,
            other => C::Other(rustls::OtherError(Arc::new(other.clone()))),
        })
    }
}

/// The URI name constraints one CA imposes (RFC 5280: `host` exactly, or
/// `.domain` for any host under it; compared case-insensitively).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UriConstraint {
    /// `None`: no permitted subtrees of URI form (anything permitted).
    pub permitted: Option<Vec<String>>,
    pub excluded: Vec<String>,
}

impl UriConstraint {
    fn is_empty(&self) -> bool {
        self.permitted.is_none() && self.excluded.is_empty()
    }

    fn permits_host(&self, host: &str) -> bool {
        let host = host.to_ascii_lowercase();
        let within = |base: &String| {
            let base = base.to_ascii_lowercase();
            match base.strip_prefix('.') {
                Some(_) => host.ends_with(&base),
                None => host == base,
            }
        };
        self.permitted.as_ref().is_none_or(|p| p.iter().any(within))
            && !self.excluded.iter().any(within)
    }
}

/// The constraints of every CA above a leaf; a name must satisfy each level.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Constraints {
    levels: Vec<UriConstraint>,
}

impl Constraints {
    /// Whether a URI (its host) is inside every level.
    pub fn permits(&self, uri: &str) -> bool {
        match uri_host(uri) {
            Some(host) => self.levels.iter().all(|l| l.permits_host(host)),
            None => self.levels.is_empty(),
        }
    }

    /// Trust domains a leaf may carry, for messages: `any` when unconstrained.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .levels
            .iter()
            .map(|l| {
                let mut s = match &l.permitted {
                    Some(p) => format!("trust domain {}", p.join(" or ")),
                    None => "any trust domain".to_string(),
                };
                if !l.excluded.is_empty() {
                    s.push_str(&format!(" except {}", l.excluded.join(", ")));
                }
                s
            })
            .collect();
        if parts.is_empty() {
            "any trust domain".into()
        } else {
            parts.join("; and ")
        }
    }

    /// The constraints of one CA certificate (DER) and of nothing above it.
    pub fn of_issuer(der: &[u8]) -> Result<Self, String> {
        let cert = X509Certificate::from_der(der)
            .map_err(|e| format!("unreadable certificate: {e}"))?
            .1;
        let own = uri_constraints(&cert)?;
        Ok(Self {
            levels: if own.is_empty() { vec![] } else { vec![own] },
        })
    }

    /// The one trust domain the constraints pin exactly, if they do.
    pub fn trust_domain(&self) -> Option<&str> {
        self.levels
            .iter()
            .find_map(|l| match l.permitted.as_deref() {
                Some([one]) if !one.starts_with('.') => Some(one.as_str()),
                _ => None,
            })
    }
}

/// The host of `scheme://host[:port][/…]`, without userinfo.
fn uri_host(uri: &str) -> Option<&str> {
    let rest = uri.split_once("://")?.1;
    let authority = rest.split(['/', '?', '#']).next()?;
    let host = authority.rsplit('@').next()?;
    let host = host.split(':').next()?;
    (!host.is_empty()).then_some(host)
}

/// Reads the URI name constraints of a CA certificate. Constraints of any
/// other form are refused: Strait would not evaluate them (fail closed).
pub fn uri_constraints(cert: &X509Certificate<'_>) -> Result<UriConstraint, String> {
    let Some(ext) = cert
        .name_constraints()
        .map_err(|e| format!("unreadable name constraints: {e}"))?
    else {
        return Ok(UriConstraint::default());
    };
    let read = |subtrees: &Option<Vec<x509_parser::extensions::GeneralSubtree<'_>>>| {
        subtrees
            .as_ref()
            .map(|trees| {
                trees
                    .iter()
                    .map(|t| match &t.base {
                        GeneralName::URI(u) => Ok(u.to_string()),
                        other => Err(format!(
                            "a name constraint of another form than URI ({other:?}), which Strait does not evaluate: make the issuer with `strait identity issuer`"
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()
    };
    Ok(UriConstraint {
        permitted: read(&ext.value.permitted_subtrees)?,
        excluded: read(&ext.value.excluded_subtrees)?.unwrap_or_default(),
    })
}

fn sha256(der: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, der);
    d.as_ref().try_into().expect("32 bytes")
}

/// Lower-case hex of a certificate's SHA-256 (how bundles and metrics name anchors).
pub fn fingerprint(der: &[u8]) -> String {
    sha256(der).iter().map(|b| format!("{b:02x}")).collect()
}

/// A CA a leaf may be verified against: an anchor or an issuer under one.
#[derive(Debug)]
struct Signer {
    anchor: TrustAnchor<'static>,
    constraints: Constraints,
    not_before: i64,
    not_after: i64,
    /// Index of the bundle's anchor the chain ends at.
    root: usize,
}

impl Signer {
    fn check_time(&self, what: &'static str, now: i64) -> Result<(), Refusal> {
        let at = |t: i64| {
            time::OffsetDateTime::from_unix_timestamp(t)
                .map(|t| t.to_string())
                .unwrap_or_else(|_| t.to_string())
        };
        if now < self.not_before {
            return Err(Refusal::NotYetValid {
                what,
                at: at(self.not_before),
            });
        }
        if now > self.not_after {
            return Err(Refusal::Expired {
                what,
                at: at(self.not_after),
            });
        }
        Ok(())
    }
}

/// One bundle's anchors and the issuers already checked under them.
#[derive(Debug)]
struct Anchors {
    anchors: Vec<Arc<Signer>>,
    ders: Vec<CertificateDer<'static>>,
    roots: Arc<RootCertStore>,
    digest: [u8; 32],
    issuers: Mutex<HashMap<[u8; 32], CheckedIssuer>>,
}

/// An issuer checked under a bundle, good or refused.
type CheckedIssuer = Result<Arc<Signer>, Refusal>;

/// At most this many issuers are remembered per bundle (a peer could send
/// many); past it the cache is cleared and refilled.
const MAX_CACHED_ISSUERS: usize = 256;

fn signer_of(
    what: &'static str,
    der: &CertificateDer<'_>,
    cert: &X509Certificate<'_>,
    root: usize,
    above: &Constraints,
) -> Result<Signer, Refusal> {
    let mut anchor = webpki::anchor_from_trusted_cert(der)
        .map_err(|e| Refusal::BadChain(format!("{what}: {e}")))?
        .to_owned();
    // Constraints are evaluated by `Constraints::permits`, not by webpki.
    anchor.name_constraints = None;
    let own = uri_constraints(cert).map_err(|e| Refusal::BadChain(format!("{what}: {e}")))?;
    let mut constraints = above.clone();
    if !own.is_empty() {
        constraints.levels.push(own);
    }
    let validity = cert.validity();
    Ok(Signer {
        anchor,
        constraints,
        not_before: validity.not_before.timestamp(),
        not_after: validity.not_after.timestamp(),
        root,
    })
}

impl Anchors {
    fn from_pem(pem: &[u8]) -> Result<Self, CertError> {
        let ders = certs::parse_certs("trust-anchor bundle", pem)?;
        let mut roots = RootCertStore::empty();
        let mut anchors = Vec::new();
        for (i, der) in ders.iter().enumerate() {
            let bad = |detail: String| CertError::X509 {
                what: format!("trust anchor #{}", i + 1),
                detail,
            };
            roots.add(der.clone()).map_err(|e| bad(e.to_string()))?;
            let cert = X509Certificate::from_der(der)
                .map_err(|e| bad(e.to_string()))?
                .1;
            let signer = signer_of("trust anchor", der, &cert, i, &Constraints::default())
                .map_err(|e| bad(e.to_string()))?;
            anchors.push(Arc::new(signer));
        }
        Ok(Self {
            anchors,
            ders,
            roots: Arc::new(roots),
            digest: sha256(pem),
            issuers: Mutex::new(HashMap::new()),
        })
    }

    /// The issuer `der`, checked under this bundle (cached by its digest).
    fn issuer(&self, der: &CertificateDer<'_>) -> Result<Arc<Signer>, Refusal> {
        let key = sha256(der);
        if let Some(known) = self.issuers.lock().expect("not poisoned").get(&key) {
            return known.clone();
        }
        let checked = self.check_issuer(der).map(Arc::new);
        let mut cache = self.issuers.lock().expect("not poisoned");
        if cache.len() >= MAX_CACHED_ISSUERS {
            cache.clear();
        }
        cache.insert(key, checked.clone());
        checked
    }

    fn check_issuer(&self, der: &CertificateDer<'_>) -> Result<Signer, Refusal> {
        let cert = X509Certificate::from_der(der)
            .map_err(|e| Refusal::BadChain(format!("issuer certificate: {e}")))?
            .1;
        if !certs::can_sign(&cert) {
            return Err(Refusal::BadChain(
                "the issuer certificate is not a CA with keyCertSign".into(),
            ));
        }
        for (i, anchor_der) in self.ders.iter().enumerate() {
            let Ok((_, anchor)) = X509Certificate::from_der(anchor_der) else {
                continue;
            };
            if anchor.subject().as_raw() == cert.issuer().as_raw()
                && cert.verify_signature(Some(anchor.public_key())).is_ok()
            {
                return signer_of(
                    "issuer certificate",
                    der,
                    &cert,
                    i,
                    &self.anchors[i].constraints,
                );
            }
        }
        Err(Refusal::UnknownAnchor {
            issuer: cert.issuer().to_string(),
        })
    }

    fn verify(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
        usage: webpki::KeyUsage,
    ) -> Result<(SpiffeId, usize), Refusal> {
        let id = certs::spiffe_id_of(end_entity).ok_or(Refusal::NoSpiffeId)?;
        // A peer may append the anchor itself; it adds nothing.
        let intermediates: Vec<&CertificateDer<'_>> = intermediates
            .iter()
            .filter(|c| !self.ders.iter().any(|a| a.as_ref() == c.as_ref()))
            .collect();
        let now_secs = now.as_secs() as i64;
        let signers: Vec<Arc<Signer>> = match intermediates.as_slice() {
            [] => self.anchors.clone(),
            [issuer] => vec![self.issuer(issuer)?],
            _ => {
                return Err(Refusal::BadChain(format!(
                    "{} intermediate certificates; Strait chains are leaf ← issuer ← anchor",
                    intermediates.len()
                )));
            }
        };
        let leaf = webpki::EndEntityCert::try_from(end_entity)
            .map_err(|e| Refusal::BadChain(format!("leaf certificate: {e}")))?;
        let algs = super::tls::provider().signature_verification_algorithms.all;
        let mut last = None;
        for signer in &signers {
            let anchor = std::slice::from_ref(&signer.anchor);
            match leaf.verify_for_usage(algs, anchor, &[], now, usage, None, None) {
                Ok(_) => {
                    let what = if intermediates.is_empty() {
                        "its trust anchor"
                    } else {
                        "its issuer"
                    };
                    signer.check_time(what, now_secs)?;
                    self.anchors[signer.root].check_time("its trust anchor", now_secs)?;
                    for uri in certs::uri_sans(end_entity) {
                        if !signer.constraints.permits(&uri) {
                            return Err(Refusal::NameConstraint {
                                id: uri,
                                allowed: signer.constraints.describe(),
                            });
                        }
                    }
                    return Ok((id, signer.root));
                }
                Err(e) => last = Some(e),
            }
        }
        Err(match last {
            Some(webpki::Error::CertExpired { not_after, .. }) => Refusal::Expired {
                what: "the certificate",
                at: format!("{} (Unix time)", not_after.as_secs()),
            },
            Some(webpki::Error::CertNotValidYet { not_before, .. }) => Refusal::NotYetValid {
                what: "the certificate",
                at: format!("{} (Unix time)", not_before.as_secs()),
            },
            Some(webpki::Error::UnknownIssuer) | None => Refusal::UnknownAnchor {
                issuer: certs::issuer_name(end_entity).unwrap_or_default(),
            },
            Some(other) => Refusal::BadChain(other.to_string()),
        })
    }
}

/// Labels of `identity_trust_anchor_info`: one series per anchor of the bundle.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AnchorLabels {
    /// The first 16 hex digits of the anchor's SHA-256.
    pub fingerprint: String,
    /// `true` for the first (active) anchor.
    pub active: &'static str,
}

/// The anchors a component trusts now, for its metrics.
pub type AnchorInfo = Family<AnchorLabels, Gauge>;

/// The trust anchors a workload accepts, shared by every config built from it.
/// Several roots are allowed so an anchor can be rotated without downtime; the
/// first is the *active* one, the anchor new certificates should chain to.
#[derive(Clone, Debug)]
pub struct TrustBundle {
    live: Arc<ArcSwap<Anchors>>,
    /// Bumped on every replacement; certificate holders watch it.
    generation: Arc<tokio::sync::watch::Sender<u64>>,
    refusals: RefusalLog,
    anchor_info: Option<AnchorInfo>,
}

impl TrustBundle {
    pub fn from_pem(pem: &[u8]) -> Result<Self, CertError> {
        Ok(Self {
            live: Arc::new(ArcSwap::from_pointee(Anchors::from_pem(pem)?)),
            generation: Arc::new(tokio::sync::watch::Sender::new(0)),
            refusals: RefusalLog::default(),
            anchor_info: None,
        })
    }

    /// The same bundle publishing its anchors in `info` (now and on every replacement).
    pub fn with_anchor_info(mut self, info: AnchorInfo) -> Self {
        self.anchor_info = Some(info);
        self.publish();
        self
    }

    fn publish(&self) {
        let Some(info) = &self.anchor_info else {
            return;
        };
        info.clear();
        for (i, print) in self.fingerprints().iter().enumerate() {
            info.get_or_create(&AnchorLabels {
                fingerprint: print[..16].to_string(),
                active: if i == 0 { "true" } else { "false" },
            })
            .set(1);
        }
    }

    /// The same bundle counting its refusals in `log` (a component's metrics).
    pub fn with_refusal_log(mut self, log: RefusalLog) -> Self {
        self.refusals = log;
        self
    }

    /// Replaces the anchors (every config built from this bundle follows at its
    /// next handshake). Returns whether anything changed.
    pub fn replace_from_pem(&self, pem: &[u8]) -> Result<bool, CertError> {
        if self.live.load().digest == sha256(pem) {
            return Ok(false);
        }
        self.live.store(Arc::new(Anchors::from_pem(pem)?));
        self.publish();
        self.generation.send_modify(|g| *g += 1);
        Ok(true)
    }

    /// Wakes whenever the anchors are replaced.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.generation.subscribe()
    }

    pub fn len(&self) -> usize {
        self.live.load().ders.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// SHA-256 of each anchor, in bundle order (the first is the active one).
    pub fn fingerprints(&self) -> Vec<String> {
        self.live
            .load()
            .ders
            .iter()
            .map(|d| fingerprint(d))
            .collect()
    }

    /// The anchors as a rustls root store (for servers named by DNS, like the issuer).
    pub fn root_store(&self) -> Arc<RootCertStore> {
        self.live.load().roots.clone()
    }

    /// Verifies a peer's chain and returns its SPIFFE ID and the index of the
    /// anchor it chains to. Refusals are counted and logged by the caller's
    /// side through [`TrustBundle::refused`].
    pub fn verify(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
        usage: webpki::KeyUsage,
    ) -> Result<(SpiffeId, usize), Refusal> {
        self.live
            .load()
            .verify(end_entity, intermediates, now, usage)
    }

    /// Counts a refusal and logs it (at most once a minute per peer).
    pub fn refused(&self, side: &'static str, peer: &CertificateDer<'_>, refusal: &Refusal) {
        self.refusals.record(side, peer, refusal);
    }

    /// The refusal counters, to register with a component's metrics.
    pub fn refusals(&self) -> &RefusalLog {
        &self.refusals
    }

    /// Whether `chain` (leaf first) ends at the active (first) anchor.
    pub fn chains_to_active(&self, chain: &[CertificateDer<'_>]) -> bool {
        let Some((leaf, rest)) = chain.split_first() else {
            return false;
        };
        let usage = webpki::KeyUsage::client_auth();
        matches!(self.verify(leaf, rest, UnixTime::now(), usage), Ok((_, 0)))
    }
}

#[cfg(test)]
mod tests;
