//! rustls configurations for Strait's mutual TLS: TLS 1.3 only, peers verified
//! against the trust-anchor bundle, and the peer's SPIFFE ID checked.
//!
//! SPIFFE IDs live in URI SANs, which the stock rustls verifiers (DNS/IP names)
//! cannot check, so the client side uses [`SpiffeServerVerifier`]: webpki chain
//! verification to the bundle, then an exact SPIFFE ID match. The server side
//! uses rustls' WebPKI client verifier for the chain and exposes the client's
//! ID through [`peer_identity`], so policy can decide per request.

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use rustls::client::ResolvesClientCert;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};

use super::SpiffeId;
use super::certs::{self, CertError};

/// The crypto provider every Strait TLS config uses.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(transparent)]
    Cert(#[from] CertError),
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("the peer presented no certificate")]
    NoPeerCertificate,
    #[error("the peer's certificate carries no (single) SPIFFE ID in its URI SANs")]
    NoSpiffeId,
}

/// The trust anchors a workload accepts. Several roots are allowed, so an
/// anchor can be rotated without downtime: ship old+new, reissue, drop old.
#[derive(Clone, Debug)]
pub struct TrustBundle {
    roots: Arc<RootCertStore>,
    anchors: Arc<Vec<rustls::pki_types::TrustAnchor<'static>>>,
}

impl TrustBundle {
    pub fn from_pem(pem: &[u8]) -> Result<Self, TlsError> {
        let certs = certs::parse_certs("trust-anchor bundle", pem)?;
        let mut roots = RootCertStore::empty();
        let mut anchors = Vec::new();
        for (i, der) in certs.iter().enumerate() {
            roots.add(der.clone())?;
            let anchor = webpki::anchor_from_trusted_cert(der).map_err(|e| CertError::X509 {
                what: format!("trust anchor #{}", i + 1),
                detail: e.to_string(),
            })?;
            anchors.push(anchor.to_owned());
        }
        Ok(Self {
            roots: Arc::new(roots),
            anchors: Arc::new(anchors),
        })
    }

    pub fn len(&self) -> usize {
        self.anchors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.anchors.is_empty()
    }

    pub fn root_store(&self) -> Arc<RootCertStore> {
        self.roots.clone()
    }
}

/// The certificate a workload presents, swapped atomically on refresh: configs
/// built once keep serving the newest certificate without being rebuilt.
#[derive(Debug, Default)]
pub struct CertSlot {
    current: ArcSwapOption<CertifiedKey>,
}

impl CertSlot {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Installs a chain (leaf first) and its PEM private key.
    pub fn install(
        &self,
        chain: Vec<CertificateDer<'static>>,
        key_pem: &str,
    ) -> Result<(), TlsError> {
        let key = certs::parse_key("workload key", key_pem.as_bytes())?;
        let certified = CertifiedKey::from_der(chain, key, &provider())?;
        self.current.store(Some(Arc::new(certified)));
        Ok(())
    }

    pub fn current(&self) -> Option<Arc<CertifiedKey>> {
        self.current.load_full()
    }
}

impl ResolvesClientCert for CertSlot {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        self.current()
    }
    fn has_certs(&self) -> bool {
        self.current.load().is_some()
    }
}

impl ResolvesServerCert for CertSlot {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current()
    }
}

/// A server config: TLS 1.3, client certificate required and chained to the bundle.
pub fn server_config(
    bundle: &TrustBundle,
    cert: Arc<CertSlot>,
    alpn: &[&[u8]],
) -> Result<ServerConfig, TlsError> {
    let verifier =
        WebPkiClientVerifier::builder_with_provider(bundle.root_store(), provider()).build()?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(cert);
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// A client config: TLS 1.3, presents `cert`, and accepts only a server whose
/// chain reaches the bundle and whose SPIFFE ID is one of `expected`.
pub fn client_config(
    bundle: &TrustBundle,
    cert: Arc<CertSlot>,
    expected: Vec<SpiffeId>,
    alpn: &[&[u8]],
) -> Result<ClientConfig, TlsError> {
    let verifier = Arc::new(SpiffeServerVerifier::new(bundle, expected));
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_cert_resolver(cert);
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// The SPIFFE ID of the peer of an established connection.
pub fn peer_identity(peer_certs: Option<&[CertificateDer<'_>]>) -> Result<SpiffeId, TlsError> {
    let leaf = peer_certs
        .and_then(|c| c.first())
        .ok_or(TlsError::NoPeerCertificate)?;
    certs::spiffe_id_of(leaf).ok_or(TlsError::NoSpiffeId)
}

/// Verifies a server's chain to the trust bundle (webpki) and its SPIFFE ID.
#[derive(Debug)]
pub struct SpiffeServerVerifier {
    anchors: Arc<Vec<rustls::pki_types::TrustAnchor<'static>>>,
    expected: Vec<SpiffeId>,
    provider: Arc<CryptoProvider>,
}

impl SpiffeServerVerifier {
    pub fn new(bundle: &TrustBundle, expected: Vec<SpiffeId>) -> Self {
        Self {
            anchors: bundle.anchors.clone(),
            expected,
            provider: provider(),
        }
    }
}

impl ServerCertVerifier for SpiffeServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = webpki::EndEntityCert::try_from(end_entity)
            .map_err(|e| rustls::Error::InvalidCertificate(webpki_error(e)))?;
        cert.verify_for_usage(
            self.provider.signature_verification_algorithms.all,
            &self.anchors,
            intermediates,
            now,
            webpki::KeyUsage::server_auth(),
            None,
            None,
        )
        .map_err(|e| rustls::Error::InvalidCertificate(webpki_error(e)))?;
        let id = certs::spiffe_id_of(end_entity).ok_or_else(|| {
            rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
                Arc::new(TlsError::NoSpiffeId),
            )))
        })?;
        if self.expected.contains(&id) {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::Other(rustls::OtherError(Arc::new(UnexpectedPeer {
                    got: id,
                    expected: self.expected.clone(),
                }))),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        // Configs are TLS 1.3 only; a 1.2 handshake never gets here.
        Err(rustls::Error::PeerIncompatible(
            rustls::PeerIncompatible::Tls13RequiredForQuic,
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The server's SPIFFE ID was valid but not the one the caller expected.
#[derive(Debug, thiserror::Error)]
#[error("peer is {got}, expected {}", expected.iter().map(ToString::to_string).collect::<Vec<_>>().join(" or "))]
pub struct UnexpectedPeer {
    pub got: SpiffeId,
    pub expected: Vec<SpiffeId>,
}

fn webpki_error(e: webpki::Error) -> rustls::CertificateError {
    use webpki::Error as E;
    match e {
        E::BadDer | E::BadDerTime => rustls::CertificateError::BadEncoding,
        E::CertNotValidYet { .. } => rustls::CertificateError::NotValidYet,
        E::CertExpired { .. } => rustls::CertificateError::Expired,
        E::UnknownIssuer => rustls::CertificateError::UnknownIssuer,
        E::InvalidSignatureForPublicKey => rustls::CertificateError::BadSignature,
        other => rustls::CertificateError::Other(rustls::OtherError(Arc::new(other))),
    }
}
