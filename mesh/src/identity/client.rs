//! The issuer client: obtains certificates for one or more identities, refreshes
//! each before it expires (at 70 % of its lifetime by default), backs off on
//! failure while keeping the still-valid certificate, and exposes the current
//! certificate through a [`CertSlot`] that rustls configs read on every handshake.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rustls::pki_types::ServerName;
use tokio::sync::{Mutex, watch};

use super::SpiffeId;
use super::certs;
use super::protocol::{
    CERTIFICATES_PATH, CertificateRequest, CertificateResponse, ErrorResponse, PodRef,
};
use super::tls::{CertSlot, TrustBundle};

#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    #[error(
        "cannot reach the issuer at {addr}: {source}; is strait-identity running and its Service reachable?"
    )]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error(
        "TLS with the issuer at {addr} failed: {source}; does the issuer's certificate chain to the trust-anchor bundle?"
    )]
    Tls {
        addr: String,
        source: std::io::Error,
    },
    #[error("HTTP to the issuer failed: {0}")]
    Http(String),
    #[error("the issuer refused ({status}, {reason}): {message}")]
    Refused {
        status: u16,
        reason: String,
        message: String,
    },
    #[error("cannot read the ServiceAccount token from {path}: {source}")]
    Token {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the issuer's answer is unusable: {0}")]
    BadResponse(String),
    #[error("cannot make a key or CSR: {0}")]
    Key(#[from] rcgen::Error),
    #[error("timed out after {0:?} talking to the issuer")]
    Timeout(Duration),
}

impl IssueError {
    /// Whether asking again later can succeed: the issuer is not reachable
    /// (yet: it may be starting beside this component), slow, or failing on
    /// its side. A refusal of this caller (4xx) or a local problem is final.
    pub fn is_transient(&self) -> bool {
        match self {
            IssueError::Connect { .. }
            | IssueError::Tls { .. }
            | IssueError::Http(_)
            | IssueError::Timeout(_) => true,
            IssueError::Refused { status, .. } => *status >= 500 || *status == 429,
            IssueError::Token { .. } | IssueError::BadResponse(_) | IssueError::Key(_) => false,
        }
    }

    /// Stable reason for metrics.
    pub fn reason(&self) -> &str {
        match self {
            IssueError::Connect { .. } => "connect",
            IssueError::Tls { .. } => "tls",
            IssueError::Http(_) => "http",
            IssueError::Refused { reason, .. } => reason,
            IssueError::Token { .. } => "token",
            IssueError::BadResponse(_) => "bad_response",
            IssueError::Key(_) => "key",
            IssueError::Timeout(_) => "timeout",
        }
    }
}

/// Where the bearer token comes from. Projected tokens rotate on disk, so a
/// file is read again for every request.
#[derive(Clone)]
pub enum TokenSource {
    File(PathBuf),
    Static(Arc<str>),
}

impl std::fmt::Debug for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenSource::File(p) => f.debug_tuple("File").field(p).finish(),
            TokenSource::Static(_) => f.write_str("Static(<redacted>)"),
        }
    }
}

impl TokenSource {
    async fn read(&self) -> Result<String, IssueError> {
        match self {
            TokenSource::Static(t) => Ok(t.to_string()),
            TokenSource::File(path) => tokio::fs::read_to_string(path)
                .await
                .map(|t| t.trim().to_string())
                .map_err(|source| IssueError::Token {
                    path: path.clone(),
                    source,
                }),
        }
    }
}

/// Talks HTTPS to the issuer, verifying its certificate (a DNS name) against
/// the trust bundle. The client presents no certificate: it has none yet.
#[derive(Clone)]
pub struct IssuerClient {
    addr: String,
    server_name: ServerName<'static>,
    tls: tokio_rustls::TlsConnector,
    timeout: Duration,
    /// The live bundle: certificates are re-fetched when its active anchor changes.
    bundle: TrustBundle,
}

impl std::fmt::Debug for IssuerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuerClient")
            .field("addr", &self.addr)
            .field("server_name", &self.server_name)
            .finish()
    }
}

impl IssuerClient {
    /// `addr` is `host:port`; `server_name` the DNS name in the issuer's certificate.
    pub fn new(
        addr: &str,
        server_name: &str,
        bundle: &TrustBundle,
    ) -> Result<Self, super::tls::TlsError> {
        let config = rustls::ClientConfig::builder_with_provider(super::tls::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(super::tls::DnsServerVerifier::new(bundle)))
            .with_no_client_auth();
        let server_name = ServerName::try_from(server_name.to_string())
            .map_err(|e| rustls::Error::General(format!("issuer name {server_name:?}: {e}")))?;
        Ok(Self {
            addr: addr.to_string(),
            server_name,
            tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
            timeout: Duration::from_secs(10),
            bundle: bundle.clone(),
        })
    }

    /// Sends one request: a fresh key pair's CSR, the token, an optional pod.
    /// Returns the response and the new private key (PEM).
    pub async fn issue(
        &self,
        token: &str,
        pod: Option<&PodRef>,
    ) -> Result<(CertificateResponse, String), IssueError> {
        let key = rcgen::KeyPair::generate()?;
        let csr = rcgen::CertificateParams::default()
            .serialize_request(&key)?
            .pem()?;
        let body = serde_json::to_vec(&CertificateRequest {
            csr,
            pod: pod.cloned(),
        })
        .expect("request serialises");
        let response = tokio::time::timeout(self.timeout, self.post(token, body))
            .await
            .map_err(|_| IssueError::Timeout(self.timeout))??;
        Ok((response, key.serialize_pem()))
    }

    async fn post(&self, token: &str, body: Vec<u8>) -> Result<CertificateResponse, IssueError> {
        let tcp = tokio::net::TcpStream::connect(&self.addr)
            .await
            .map_err(|source| IssueError::Connect {
                addr: self.addr.clone(),
                source,
            })?;
        let _ = tcp.set_nodelay(true);
        let tls = self
            .tls
            .connect(self.server_name.clone(), tcp)
            .await
            .map_err(|source| IssueError::Tls {
                addr: self.addr.clone(),
                source,
            })?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| IssueError::Http(e.to_string()))?;
        tokio::spawn(conn);
        let request = hyper::Request::post(CERTIFICATES_PATH)
            .header(hyper::header::HOST, self.server_name.to_str().as_ref())
            .header(hyper::header::AUTHORIZATION, format!("Bearer {token}"))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| IssueError::Http(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| IssueError::Http(e.to_string()))?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), 256 * 1024)
            .collect()
            .await
            .map_err(|e| IssueError::Http(e.to_string()))?
            .to_bytes();
        if !status.is_success() {
            let err: ErrorResponse =
                serde_json::from_slice(&bytes).unwrap_or_else(|_| ErrorResponse {
                    reason: "http_error".into(),
                    message: String::from_utf8_lossy(&bytes).into_owned(),
                });
            return Err(IssueError::Refused {
                status: status.as_u16(),
                reason: err.reason,
                message: err.message,
            });
        }
        serde_json::from_slice(&bytes).map_err(|e| IssueError::BadResponse(e.to_string()))
    }
}

/// When to refresh and how to back off.
#[derive(Clone, Copy, Debug)]
pub struct RefreshPolicy {
    /// Fraction of the lifetime after which to refresh (0.7 = at 70 %).
    pub at_fraction: f64,
    pub min_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for RefreshPolicy {
    fn default() -> Self {
        Self {
            at_fraction: 0.7,
            min_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct IdentityLabels {
    identity: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefreshLabels {
    result: String,
}

/// Client-side identity metrics.
#[derive(Clone, Debug, Default)]
pub struct IdentityMetrics {
    expiry: Family<IdentityLabels, Gauge>,
    refreshes: Family<RefreshLabels, Counter>,
    active_anchor: Family<IdentityLabels, Gauge>,
    refusals: super::refusals::RefusalLog,
    anchors: super::trust::AnchorInfo,
}

impl IdentityMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "identity_cert_expiration_timestamp_seconds",
            "Expiry of the current certificate of each identity, seconds since the Unix epoch",
            self.expiry.clone(),
        );
        registry.register(
            "identity_refresh",
            "Certificate fetches and refreshes by result (ok or the failure reason)",
            self.refreshes.clone(),
        );
        registry.register(
            "identity_cert_chains_to_active_anchor",
            "1 if the current certificate of each identity chains to the first (active) anchor of the trust bundle, else 0 (a rotation is under way)",
            self.active_anchor.clone(),
        );
        registry.register(
            "identity_trust_anchor_info",
            "The trust anchors this component verifies peers with (1 per anchor; active: the first, which certificates should chain to)",
            self.anchors.clone(),
        );
        self.refusals.register(registry);
    }

    /// Where a trust bundle publishes its anchors.
    pub fn anchor_info(&self) -> super::trust::AnchorInfo {
        self.anchors.clone()
    }

    /// The handshake refusals of this component's trust bundle.
    pub fn refusals(&self) -> super::refusals::RefusalLog {
        self.refusals.clone()
    }
}

/// One identity kept fresh in the background. Dropping the last handle stops
/// its refresh task.
#[derive(Debug)]
pub struct ManagedIdentity {
    slot: Arc<CertSlot>,
    id: watch::Receiver<Option<SpiffeId>>,
    expires_at: Arc<AtomicI64>,
    /// The pod the issuer is asked for (a node proxy's identities): it may
    /// change to another pod of the same account ([`ManagedIdentity::rebind`]).
    pod: Arc<std::sync::Mutex<Option<PodRef>>>,
    /// Wakes the refresher for a fetch now.
    refresh_now: Arc<tokio::sync::Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ManagedIdentity {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ManagedIdentity {
    /// Fetches the first certificate (waiting for it), then refreshes in the background.
    pub async fn start(
        client: IssuerClient,
        token: TokenSource,
        pod: Option<PodRef>,
        policy: RefreshPolicy,
        metrics: IdentityMetrics,
    ) -> Result<Self, IssueError> {
        let slot = CertSlot::new();
        let expires_at = Arc::new(AtomicI64::new(0));
        let pod = Arc::new(std::sync::Mutex::new(pod));
        let refresh_now = Arc::new(tokio::sync::Notify::new());
        let worker = Worker {
            client,
            token,
            pod: pod.clone(),
            policy,
            metrics,
            slot: slot.clone(),
            expires_at: expires_at.clone(),
            refresh_now: refresh_now.clone(),
        };
        let (issued_at, first_id) = worker.fetch_once().await?;
        let (tx, rx) = watch::channel(Some(first_id));
        let task = tokio::spawn(worker.run(issued_at, tx));
        Ok(Self {
            slot,
            id: rx,
            expires_at,
            pod,
            refresh_now,
            task,
        })
    }

    /// The pod this identity is fetched for (`None`: the holder's own).
    pub fn pod(&self) -> Option<PodRef> {
        self.pod.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Fetches this identity for `pod` from now on, at once: the pod it was
    /// fetched for left the node while another pod of the same account still
    /// runs there (the issuer certifies a node agent only for its node's
    /// pods, so a refresh naming the gone pod would fail until the
    /// certificate expired). The fetch now proves the new binding; a failure
    /// keeps the valid certificate and is retried with the usual backoff.
    pub fn rebind(&self, pod: PodRef) {
        *self.pod.lock().unwrap_or_else(|e| e.into_inner()) = Some(pod);
        self.refresh_now.notify_one();
    }

    /// The certificate slot to hand to rustls configs.
    pub fn cert(&self) -> Arc<CertSlot> {
        self.slot.clone()
    }

    pub fn id(&self) -> SpiffeId {
        self.id
            .borrow()
            .clone()
            .expect("set before start() returns")
    }

    /// Expiry of the current certificate, seconds since the Unix epoch.
    pub fn expires_at(&self) -> i64 {
        self.expires_at.load(Ordering::Relaxed)
    }
}

struct Worker {
    client: IssuerClient,
    token: TokenSource,
    pod: Arc<std::sync::Mutex<Option<PodRef>>>,
    policy: RefreshPolicy,
    metrics: IdentityMetrics,
    slot: Arc<CertSlot>,
    expires_at: Arc<AtomicI64>,
    refresh_now: Arc<tokio::sync::Notify>,
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

impl Worker {
    async fn fetch_once(&self) -> Result<(i64, SpiffeId), IssueError> {
        let result = self.fetch_inner().await;
        let label = match &result {
            Ok(_) => "ok".to_string(),
            Err(e) => e.reason().to_string(),
        };
        self.metrics
            .refreshes
            .get_or_create(&RefreshLabels { result: label })
            .inc();
        result
    }

    async fn fetch_inner(&self) -> Result<(i64, SpiffeId), IssueError> {
        let issued_at = unix_now();
        let token = self.token.read().await?;
        let pod = self.pod.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let (response, key_pem) = self.client.issue(&token, pod.as_ref()).await?;
        let mut chain = certs::parse_certs("issued certificate", response.certificate.as_bytes())
            .map_err(|e| IssueError::BadResponse(e.to_string()))?;
        chain.extend(
            certs::parse_certs("issued chain", response.chain.as_bytes())
                .map_err(|e| IssueError::BadResponse(e.to_string()))?,
        );
        if certs::spiffe_id_of(&chain[0]).as_ref() != Some(&response.identity) {
            return Err(IssueError::BadResponse(
                "certificate SAN does not match the identity field".into(),
            ));
        }
        let active = self.client.bundle.chains_to_active(&chain);
        self.slot
            .install(chain, &key_pem)
            .map_err(|e| IssueError::BadResponse(e.to_string()))?;
        self.metrics
            .active_anchor
            .get_or_create(&IdentityLabels {
                identity: response.identity.to_string(),
            })
            .set(i64::from(active));
        self.expires_at
            .store(response.expires_at, Ordering::Relaxed);
        self.metrics
            .expiry
            .get_or_create(&IdentityLabels {
                identity: response.identity.to_string(),
            })
            .set(response.expires_at);
        tracing::info!(identity = %response.identity, expires_at = response.expires_at, "certificate installed");
        Ok((issued_at, response.identity))
    }

    /// Whether the installed certificate chains to the bundle's active anchor.
    fn on_active_anchor(&self) -> bool {
        self.slot
            .current()
            .is_some_and(|c| self.client.bundle.chains_to_active(&c.cert))
    }

    /// Refreshes at `at_fraction` of each certificate's life, and at once
    /// (after up to 1 s of jitter, so a node's identities do not all ask in
    /// the same instant) when the trust bundle's active anchor changes and
    /// the certificate does not chain to it: a rotation moves every holder to
    /// the new anchor without a restart. Until the issuer signs under the new
    /// anchor, the re-fetch is retried with the usual backoff.
    async fn run(self, mut issued_at: i64, ids: watch::Sender<Option<SpiffeId>>) {
        let mut anchors = self.client.bundle.changes();
        anchors.mark_unchanged();
        loop {
            let expires = self.expires_at.load(Ordering::Relaxed);
            let lifetime = (expires - issued_at).max(1) as f64;
            let refresh_at = issued_at + (lifetime * self.policy.at_fraction) as i64;
            let wait = Duration::from_secs((refresh_at - unix_now()).max(0) as u64);
            let rotated = tokio::select! {
                _ = tokio::time::sleep(wait) => false,
                _ = self.refresh_now.notified() => false,
                changed = anchors.changed() => changed.is_ok(),
            };
            if rotated {
                // The gauge answers for the bundle of now, not the one the
                // certificate was fetched under: an operator waits on it
                // before dropping the old anchor.
                let on_active = self.on_active_anchor();
                if let Some(id) = ids.borrow().as_ref() {
                    self.metrics
                        .active_anchor
                        .get_or_create(&IdentityLabels {
                            identity: id.to_string(),
                        })
                        .set(i64::from(on_active));
                }
                if on_active {
                    continue;
                }
                tokio::time::sleep(jitter(Duration::from_secs(1))).await;
            }
            let mut backoff = self.policy.min_backoff;
            loop {
                match self.fetch_once().await {
                    Ok((_, id)) if rotated && !self.on_active_anchor() => {
                        // Still signed under the old anchor: the issuer has
                        // not been re-issued yet. Keep it and ask again.
                        ids.send_replace(Some(id));
                        tracing::info!(retry_in = ?backoff, "certificate not yet under the active trust anchor");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(self.policy.max_backoff);
                    }
                    Ok((at, id)) => {
                        issued_at = at;
                        ids.send_replace(Some(id));
                        break;
                    }
                    Err(e) => {
                        // Keep serving the current certificate while it is valid.
                        let left = self.expires_at.load(Ordering::Relaxed) - unix_now();
                        tracing::warn!(error = %e, seconds_left = left, retry_in = ?backoff, "certificate refresh failed");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(self.policy.max_backoff);
                    }
                }
            }
        }
    }
}

/// A random duration below `max`.
fn jitter(max: Duration) -> Duration {
    let mut bytes = [0u8; 4];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes);
    max.mul_f64(f64::from(u32::from_le_bytes(bytes)) / f64::from(u32::MAX))
}

/// Several identities (a node proxy holds one per ServiceAccount of its pods),
/// fetched on first use and kept fresh.
#[derive(Debug)]
pub struct IdentityStore {
    client: IssuerClient,
    token: TokenSource,
    policy: RefreshPolicy,
    metrics: IdentityMetrics,
    identities: Mutex<HashMap<Option<PodRef>, Arc<ManagedIdentity>>>,
}

impl IdentityStore {
    pub fn new(
        client: IssuerClient,
        token: TokenSource,
        policy: RefreshPolicy,
        metrics: IdentityMetrics,
    ) -> Self {
        Self {
            client,
            token,
            policy,
            metrics,
            identities: Mutex::new(HashMap::new()),
        }
    }

    /// The caller's own identity (`pod = None`) or a pod's on this node.
    pub async fn get(&self, pod: Option<PodRef>) -> Result<Arc<ManagedIdentity>, IssueError> {
        let mut map = self.identities.lock().await;
        if let Some(found) = map.get(&pod) {
            return Ok(found.clone());
        }
        let identity = Arc::new(
            ManagedIdentity::start(
                self.client.clone(),
                self.token.clone(),
                pod.clone(),
                self.policy,
                self.metrics.clone(),
            )
            .await?,
        );
        map.insert(pod, identity.clone());
        Ok(identity)
    }

    /// The caller's own identity, waiting for the issuer while it is not
    /// reachable (components start together; the issuer may come up last):
    /// transient failures are logged and retried with backoff, a refusal
    /// fails at once.
    pub async fn own(&self) -> Result<Arc<ManagedIdentity>, IssueError> {
        retry_transient(|| self.get(None)).await
    }

    /// Stops holding `identity` (no pod of its account is left on the node):
    /// its refresher stops with the last connection using it, and its
    /// per-identity metric series go.
    pub async fn forget(&self, identity: &Arc<ManagedIdentity>) {
        self.identities
            .lock()
            .await
            .retain(|_, held| !Arc::ptr_eq(held, identity));
        let labels = IdentityLabels {
            identity: identity.id().to_string(),
        };
        self.metrics.expiry.remove(&labels);
        self.metrics.active_anchor.remove(&labels);
    }
}

/// Runs `attempt` until it succeeds or fails for good ([`IssueError::is_transient`]);
/// transient failures are logged and retried after 0.5 s, doubling to 10 s.
pub async fn retry_transient<T, F, Fut>(mut attempt: F) -> Result<T, IssueError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, IssueError>>,
{
    let mut delay = Duration::from_millis(500);
    loop {
        match attempt().await {
            Err(e) if e.is_transient() => {
                tracing::warn!(error = %e, retry_in = ?delay, "no certificate from the issuer yet");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(10));
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(status: u16) -> IssueError {
        IssueError::Refused {
            status,
            reason: "r".into(),
            message: "m".into(),
        }
    }

    #[test]
    fn only_failures_that_can_pass_later_are_transient() {
        let io = || std::io::Error::other("x");
        for transient in [
            IssueError::Connect {
                addr: "a".into(),
                source: io(),
            },
            IssueError::Tls {
                addr: "a".into(),
                source: io(),
            },
            IssueError::Http("reset".into()),
            IssueError::Timeout(Duration::from_secs(1)),
            refused(503),
            refused(429),
        ] {
            assert!(transient.is_transient(), "{transient}");
        }
        for last in [
            refused(403),
            refused(400),
            IssueError::Token {
                path: "/t".into(),
                source: io(),
            },
            IssueError::BadResponse("?".into()),
        ] {
            assert!(!last.is_transient(), "{last}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn retry_transient_retries_until_success_and_stops_at_a_refusal() {
        let attempts = std::sync::atomic::AtomicU32::new(0);
        let got = retry_transient(|| async {
            match attempts.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
                0 | 1 => Err(IssueError::Http("not yet".into())),
                n => Ok(n),
            }
        })
        .await;
        assert_eq!(got.unwrap(), 2, "two transient failures, then success");
        let attempts = std::sync::atomic::AtomicU32::new(0);
        let got: Result<(), _> = retry_transient(|| async {
            attempts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Err(refused(403))
        })
        .await;
        assert!(got.is_err());
        assert_eq!(attempts.into_inner(), 1, "a refusal is not retried");
    }
}
