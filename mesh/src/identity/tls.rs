//! rustls configurations for Strait's mutual TLS: TLS 1.3 only, and every
//! peer verified by [`TrustBundle::verify`] (chain to the live anchor bundle,
//! issuer name constraints, one SPIFFE ID). The client side also requires the
//! server's SPIFFE ID to be one it expects; the server side exposes the
//! client's ID through [`peer_identity`], so policy can decide per request.
//! Refusals are counted and logged by the bundle's [`RefusalLog`].
//!
//! [`RefusalLog`]: super::refusals::RefusalLog

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use rustls::client::ResolvesClientCert;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{
    ClientConfig, DigitallySignedStruct, DistinguishedName, ServerConfig, SignatureScheme,
};

use super::SpiffeId;
use super::certs::{self, CertError};
use super::trust::Refusal;

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

pub use super::trust::TrustBundle;

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

/// A server config: TLS 1.3, client certificate required, chained to the
/// bundle within its issuer's name constraints, carrying a SPIFFE ID. No
/// session resumption: a resumed TLS 1.3 session skips the certificate
/// verifier, so a peer whose anchor was rotated out, or whose certificate
/// expired, could come back on an old ticket. Every connection proves itself
/// against the live bundle (connections are pooled; handshakes are rare).
pub fn server_config(
    bundle: &TrustBundle,
    cert: Arc<CertSlot>,
    alpn: &[&[u8]],
) -> Result<ServerConfig, TlsError> {
    let verifier = Arc::new(SpiffeClientVerifier {
        bundle: bundle.clone(),
        provider: provider(),
    });
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(cert);
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    config.send_tls13_tickets = 0;
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
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
    client_config_expecting(bundle, cert, Expected::Ids(expected), alpn)
}

/// Which servers a client accepts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expected {
    /// Exactly these identities.
    Ids(Vec<SpiffeId>),
    /// Any ServiceAccount of one namespace of one trust domain: the workloads
    /// behind a remote Service, whose accounts the caller cannot know (with
    /// name-constrained issuers, only that cluster's issuer mints them).
    Namespace {
        trust_domain: String,
        namespace: String,
    },
}

impl Expected {
    pub fn admits(&self, id: &SpiffeId) -> bool {
        match self {
            Expected::Ids(ids) => ids.contains(id),
            Expected::Namespace {
                trust_domain,
                namespace,
            } => id.trust_domain() == trust_domain && id.namespace() == namespace,
        }
    }
}

impl std::fmt::Display for Expected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Expected::Ids(ids) => {
                let ids: Vec<String> = ids.iter().map(ToString::to_string).collect();
                write!(f, "{}", ids.join(" or "))
            }
            Expected::Namespace {
                trust_domain,
                namespace,
            } => write!(f, "spiffe://{trust_domain}/ns/{namespace}/sa/<any>"),
        }
    }
}

/// As [`client_config`], accepting the servers `expected` admits.
pub fn client_config_expecting(
    bundle: &TrustBundle,
    cert: Arc<CertSlot>,
    expected: Expected,
    alpn: &[&[u8]],
) -> Result<ClientConfig, TlsError> {
    let verifier = Arc::new(SpiffeServerVerifier {
        bundle: bundle.clone(),
        expected,
        provider: provider(),
    });
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_cert_resolver(cert);
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    // As the server side: every connection verifies the server's chain.
    config.resumption = rustls::client::Resumption::disabled();
    Ok(config)
}

/// The SPIFFE ID of the peer of an established connection.
pub fn peer_identity(peer_certs: Option<&[CertificateDer<'_>]>) -> Result<SpiffeId, TlsError> {
    let leaf = peer_certs
        .and_then(|c| c.first())
        .ok_or(TlsError::NoPeerCertificate)?;
    certs::spiffe_id_of(leaf).ok_or(TlsError::NoSpiffeId)
}

/// Verifies a server's chain to the trust bundle and its SPIFFE ID.
#[derive(Debug)]
pub struct SpiffeServerVerifier {
    bundle: TrustBundle,
    expected: Expected,
    provider: Arc<CryptoProvider>,
}

impl SpiffeServerVerifier {
    pub fn new(bundle: &TrustBundle, expected: Vec<SpiffeId>) -> Self {
        Self {
            bundle: bundle.clone(),
            expected: Expected::Ids(expected),
            provider: provider(),
        }
    }

    fn check(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<(), Refusal> {
        let (id, _) = self.bundle.verify(
            end_entity,
            intermediates,
            now,
            webpki::KeyUsage::server_auth(),
        )?;
        if self.expected.admits(&id) {
            Ok(())
        } else {
            Err(Refusal::WrongIdentity {
                got: id,
                expected: self.expected.to_string(),
            })
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
        self.check(end_entity, intermediates, now)
            .map(|()| ServerCertVerified::assertion())
            .map_err(|refusal| {
                self.bundle.refused("client", end_entity, &refusal);
                refusal.to_rustls()
            })
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        tls12_refused()
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13(&self.provider, message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Verifies a client's chain to the trust bundle (the SPIFFE ID is then read
/// with [`peer_identity`] and decided by policy).
#[derive(Debug)]
struct SpiffeClientVerifier {
    bundle: TrustBundle,
    provider: Arc<CryptoProvider>,
}

impl ClientCertVerifier for SpiffeClientVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.bundle
            .verify(
                end_entity,
                intermediates,
                now,
                webpki::KeyUsage::client_auth(),
            )
            .map(|_| ClientCertVerified::assertion())
            .map_err(|refusal| {
                self.bundle.refused("server", end_entity, &refusal);
                refusal.to_rustls()
            })
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        tls12_refused()
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13(&self.provider, message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Verifies a server reached by DNS name (the issuer): the chain as for any
/// peer, then the name against its DNS SANs.
#[derive(Debug)]
pub struct DnsServerVerifier {
    bundle: TrustBundle,
    provider: Arc<CryptoProvider>,
}

impl DnsServerVerifier {
    pub fn new(bundle: &TrustBundle) -> Self {
        Self {
            bundle: bundle.clone(),
            provider: provider(),
        }
    }
}

impl ServerCertVerifier for DnsServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if let Err(refusal) = self.bundle.verify(
            end_entity,
            intermediates,
            now,
            webpki::KeyUsage::server_auth(),
        ) {
            self.bundle.refused("client", end_entity, &refusal);
            return Err(refusal.to_rustls());
        }
        let cert = webpki::EndEntityCert::try_from(end_entity)
            .map_err(|e| rustls::Error::InvalidCertificate(webpki_error(e)))?;
        cert.verify_is_valid_for_subject_name(server_name)
            .map_err(|e| rustls::Error::InvalidCertificate(webpki_error(e)))?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        tls12_refused()
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13(&self.provider, message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

fn tls12_refused() -> Result<HandshakeSignatureValid, rustls::Error> {
    // Configs are TLS 1.3 only; a 1.2 handshake never gets here.
    Err(rustls::Error::PeerIncompatible(
        rustls::PeerIncompatible::Tls13RequiredForQuic,
    ))
}

fn verify_tls13(
    provider: &CryptoProvider,
    message: &[u8],
    cert: &CertificateDer<'_>,
    dss: &DigitallySignedStruct,
) -> Result<HandshakeSignatureValid, rustls::Error> {
    rustls::crypto::verify_tls13_signature(
        message,
        cert,
        dss,
        &provider.signature_verification_algorithms,
    )
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
