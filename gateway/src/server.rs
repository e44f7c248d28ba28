//! The gateway's data path: QUIC (UDP 4143) and TCP + TLS (TCP 4143) in,
//! one tunnel header per stream, the policy, and on through this cluster's
//! node proxies to a pod of the named Service, carrying the caller's identity.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use strait_mesh::discovery::{Discovery, Route};
use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::client::ManagedIdentity;
use strait_mesh::identity::tls::{self, TrustBundle};
use strait_mesh::names::ClusterNames;
use strait_mesh::tunnel::client::open_to_pod;
use strait_mesh::tunnel::quic::TUNNEL_H2_ALPN;
use strait_mesh::tunnel::{
    DEFAULT_READ_TIMEOUT, ResponseStatus, TUNNEL_ALPN, Target, TunnelHeader, TunnelResponse,
};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::watch;

use strait_mesh::limits::{
    BoundedFamily, ConnLimit, DEFAULT_MAX_LABEL_SETS, OVERFLOW_LABEL, Overflow, OverflowMetrics,
};

use crate::policy;
use crate::refusal::{Refusal, Revoked, ServiceName};

/// QUIC handshakes in progress past which a peer must first prove its
/// address with a Retry token (RFC 9000 §8.1.2).
const MAX_UNVALIDATED_HANDSHAKES: usize = 256;

/// How long a TCP + TLS handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a QUIC handshake may take once accepted (then the connection is
/// dropped, whatever its timers would allow; after it, [`Silence`]
/// bounds a silent peer).
const QUIC_HANDSHAKE_TIMEOUT: Duration = strait_mesh::tunnel::quic::IDLE_TIMEOUT;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StreamLabels {
    /// `quic` or `tcp`.
    pub transport: String,
    /// The caller's cluster (named from its trust domain as
    /// [`ClusterNames`] does) and its trust domain.
    pub src_cluster: String,
    pub src_trust_domain: String,
    pub src_namespace: String,
    pub src_workload: String,
    /// This gateway's cluster.
    pub dst_cluster: String,
    pub dst_namespace: String,
    pub dst_service: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeniedLabels {
    pub reason: String,
    pub src_cluster: String,
    pub src_trust_domain: String,
    pub dst_cluster: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransportLabels {
    pub transport: String,
}

impl Overflow for StreamLabels {
    fn overflow() -> Self {
        let other = || OVERFLOW_LABEL.to_string();
        Self {
            transport: other(),
            src_cluster: other(),
            src_trust_domain: other(),
            src_namespace: other(),
            src_workload: other(),
            dst_cluster: other(),
            dst_namespace: other(),
            dst_service: other(),
        }
    }
}

impl Overflow for DeniedLabels {
    fn overflow() -> Self {
        let other = || OVERFLOW_LABEL.to_string();
        Self {
            reason: other(),
            src_cluster: other(),
            src_trust_domain: other(),
            dst_cluster: other(),
        }
    }
}

/// `/metrics` of the gateway. Label sets named by callers (their trust
/// domain, namespace, workload) and by the Services they ask for are bounded
/// ([`BoundedFamily`]: past [`DEFAULT_MAX_LABEL_SETS`], one `other` series).
#[derive(Clone, Debug)]
pub struct GatewayMetrics {
    pub connections: Family<TransportLabels, Counter>,
    pub streams: BoundedFamily<StreamLabels, Counter>,
    pub stream_bytes: BoundedFamily<StreamLabels, Counter>,
    /// How long forwarded streams lasted (a pooled HTTP stream carries many
    /// requests: the gateway sees only the end-to-end session's bytes).
    pub stream_duration: BoundedFamily<StreamLabels, Histogram>,
    pub denied: BoundedFamily<DeniedLabels, Counter>,
    pub open_streams: Gauge,
    pub probes: Family<TransportLabels, Counter>,
    /// QUIC handshakes answered with a Retry (too many in progress).
    pub quic_retries: Counter,
    overflows: OverflowMetrics,
}

impl Default for GatewayMetrics {
    fn default() -> Self {
        Self::with_max_label_sets(DEFAULT_MAX_LABEL_SETS)
    }
}

impl GatewayMetrics {
    pub fn with_max_label_sets(max: usize) -> Self {
        let overflows = OverflowMetrics::default();
        Self {
            connections: Family::default(),
            streams: BoundedFamily::new("gateway_streams", max, &overflows),
            stream_bytes: BoundedFamily::new("gateway_stream_bytes", max, &overflows),
            stream_duration: BoundedFamily::with_constructor(
                "gateway_stream_duration_seconds",
                max,
                &overflows,
                || Histogram::new(exponential_buckets(0.001, 4.0, 10)),
            ),
            denied: BoundedFamily::new("gateway_denied", max, &overflows),
            open_streams: Gauge::default(),
            probes: Family::default(),
            quic_retries: Counter::default(),
            overflows,
        }
    }

    pub fn register(&self, registry: &mut Registry) {
        self.overflows.register(registry);
        registry.register(
            "gateway_quic_retries",
            "QUIC handshakes asked to prove their address first (Retry) because too many were in progress",
            self.quic_retries.clone(),
        );
        registry.register(
            "gateway_connections",
            "Connections accepted, by transport",
            self.connections.clone(),
        );
        registry.register(
            "gateway_streams",
            "Streams forwarded to a pod, by caller and Service",
            self.streams.family().clone(),
        );
        registry.register(
            "gateway_stream_bytes",
            "Bytes carried both ways by forwarded streams",
            self.stream_bytes.family().clone(),
        );
        registry.register(
            "gateway_stream_duration_seconds",
            "How long forwarded streams lasted, from the caller's header to the last byte",
            self.stream_duration.family().clone(),
        );
        registry.register(
            "gateway_denied",
            "Streams refused, by reason",
            self.denied.family().clone(),
        );
        registry.register(
            "gateway_probes",
            "Probes answered (through the tunnel), by transport",
            self.probes.clone(),
        );
        registry.register(
            "gateway_open_streams",
            "Streams open now",
            self.open_streams.clone(),
        );
    }
}

pub struct Gateway {
    pub cluster: String,
    /// Callers' clusters, named from their trust domains.
    clusters: ClusterNames,
    pub discovery: Discovery,
    pub identity: Arc<ManagedIdentity>,
    pub bundle: TrustBundle,
    pub metrics: GatewayMetrics,
    /// Client configs by destination pod identity (building one validates the anchors).
    configs: Mutex<HashMap<SpiffeId, Arc<rustls::ClientConfig>>>,
    next: AtomicUsize,
    /// Streams open now (for the drain).
    active: Arc<AtomicUsize>,
    /// Refusals are logged once a minute per peer at most (all are counted).
    refusal_log: strait_mesh::telemetry::PeerLogLimit,
}

struct StreamGuard(Arc<AtomicUsize>, Gauge);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
        self.1.dec();
    }
}

impl Gateway {
    pub fn new(
        cluster: &str,
        discovery: Discovery,
        identity: Arc<ManagedIdentity>,
        bundle: TrustBundle,
        metrics: GatewayMetrics,
    ) -> Arc<Self> {
        Arc::new(Self {
            cluster: cluster.to_string(),
            clusters: ClusterNames::new(cluster, identity.id().trust_domain()),
            discovery,
            identity,
            bundle,
            metrics,
            configs: Mutex::new(HashMap::new()),
            next: AtomicUsize::new(0),
            active: Arc::default(),
            refusal_log: Default::default(),
        })
    }

    /// The server side's TLS: TLS 1.3, client certificates under the anchor
    /// required, the tunnel ALPN; follows the gateway's certificate refreshes.
    pub fn server_tls(&self) -> Result<rustls::ServerConfig, tls::TlsError> {
        self.server_tls_with(&[TUNNEL_ALPN])
    }

    /// The same with other ALPNs: the TCP fallback offers HTTP/2 multiplexing
    /// first (`[TUNNEL_H2_ALPN, TUNNEL_ALPN]`), the admin port `http/1.1`.
    pub fn server_tls_with(&self, alpn: &[&[u8]]) -> Result<rustls::ServerConfig, tls::TlsError> {
        tls::server_config(&self.bundle, self.identity.cert(), alpn)
    }

    /// Streams open now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    /// Accepts QUIC connections until `stop` turns true.
    pub async fn serve_quic(
        self: Arc<Self>,
        endpoint: quinn::Endpoint,
        limit: ConnLimit,
        mut stop: watch::Receiver<bool>,
    ) {
        let handshaking = Arc::new(AtomicUsize::new(0));
        let silence = Arc::new(Silence::default());
        // One timer for every connection; it ends with this loop.
        let _sweeper = AbortOnDrop(tokio::spawn(silence.clone().sweep()));
        loop {
            let incoming = tokio::select! {
                i = endpoint.accept() => i,
                _ = stop.wait_for(|s| *s) => return,
            };
            let Some(incoming) = incoming else { return };
            // Under a flood of handshakes, a peer first proves it receives
            // at its address (a Retry token, one more round trip) before
            // the gateway spends a key exchange and a signature on it: a
            // flood of Initials that never answer costs a packet each.
            if handshaking.load(Ordering::Acquire) >= MAX_UNVALIDATED_HANDSHAKES
                && !incoming.remote_address_validated()
            {
                self.metrics.quic_retries.inc();
                let _ = incoming.retry();
                continue;
            }
            let Some(permit) = limit.try_acquire() else {
                incoming.refuse();
                continue;
            };
            let this = self.clone();
            let silence = silence.clone();
            // Counted here, not in the task: under a flood this loop runs
            // far ahead of the tasks it spawns, and a count they raise
            // later would let thousands past the Retry threshold.
            handshaking.fetch_add(1, Ordering::AcqRel);
            let handshaking = handshaking.clone();
            tokio::spawn(async move {
                let _permit = permit;
                // A peer that never finishes its handshake is dropped (and
                // the connection closed) at the time-out, whatever its
                // retransmission timers would allow.
                let accepted = tokio::time::timeout(QUIC_HANDSHAKE_TIMEOUT, incoming).await;
                handshaking.fetch_sub(1, Ordering::AcqRel);
                let connection = match accepted {
                    Ok(Ok(c)) => c,
                    Ok(Err(e)) => {
                        tracing::debug!("QUIC handshake: {e}");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(
                            "QUIC handshake: not done within {QUIC_HANDSHAKE_TIMEOUT:?}"
                        );
                        return;
                    }
                };
                let remote = connection.remote_address();
                let Some(peer) = quic_peer(&connection) else {
                    tracing::info!(%remote, "QUIC peer without a SPIFFE identity: closing");
                    connection.close(1u32.into(), b"no identity");
                    return;
                };
                this.metrics
                    .connections
                    .get_or_create(&TransportLabels {
                        transport: "quic".into(),
                    })
                    .inc();
                let _watched = silence.watch(&connection);
                let mut credit = strait_mesh::tunnel::quic::StreamCredit::default();
                loop {
                    match connection.accept_bi().await {
                        Ok((send, recv)) => {
                            let (this, peer) = (this.clone(), peer.clone());
                            let open = credit.accepted(&connection);
                            tokio::spawn(async move {
                                let _open = open;
                                let stream = tokio::io::join(recv, send);
                                this.stream(stream, peer, "quic").await;
                            });
                        }
                        Err(e) => {
                            tracing::debug!(%remote, "QUIC connection ended: {e}");
                            return;
                        }
                    }
                }
            });
        }
    }

    /// Accepts TCP + TLS connections (the fallback) until `stop` turns true.
    pub async fn serve_tcp(
        self: Arc<Self>,
        listener: TcpListener,
        tls: Arc<rustls::ServerConfig>,
        limit: ConnLimit,
        mut stop: watch::Receiver<bool>,
    ) {
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = stop.wait_for(|s| *s) => return,
            };
            let (tcp, remote) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!("TCP accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Some(permit) = limit.try_acquire() else {
                drop(tcp);
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let (this, acceptor) = (self.clone(), acceptor.clone());
            tokio::spawn(async move {
                let _permit = permit;
                let tls = match tokio::time::timeout(
                    HANDSHAKE_TIMEOUT,
                    acceptor.accept(strait_mesh::io::ReadAhead::new(tcp)),
                )
                .await
                {
                    Ok(Ok(t)) => t,
                    Ok(Err(e)) => {
                        tracing::debug!(%remote, "TLS handshake: {e}");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%remote, "TLS handshake timed out");
                        return;
                    }
                };
                let Ok(peer) = tls::peer_identity(tls.get_ref().1.peer_certificates()) else {
                    tracing::info!(%remote, "TLS peer without a SPIFFE identity: closing");
                    return;
                };
                this.metrics
                    .connections
                    .get_or_create(&TransportLabels {
                        transport: "tcp".into(),
                    })
                    .inc();
                if tls.get_ref().1.alpn_protocol() == Some(TUNNEL_H2_ALPN) {
                    this.serve_h2(tls, peer).await;
                } else {
                    this.stream(tls, peer, "tcp").await;
                }
            });
        }
    }

    /// The TCP fallback multiplexed: every HTTP/2 CONNECT is one tunnel
    /// stream (the header follows inside it).
    async fn serve_h2(self: Arc<Self>, tls: strait_mesh::io::ServerTls, peer: SpiffeId) {
        use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
        let this = self.clone();
        let service =
            hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                let (this, peer) = (this.clone(), peer.clone());
                async move {
                    let empty = http_body_util::Empty::<bytes::Bytes>::new();
                    if req.method() != http::Method::CONNECT {
                        let mut refused = http::Response::new(empty);
                        *refused.status_mut() = http::StatusCode::METHOD_NOT_ALLOWED;
                        return Ok::<_, std::convert::Infallible>(refused);
                    }
                    tokio::spawn(async move {
                        match hyper::upgrade::on(req).await {
                            Ok(upgraded) => this.stream(TokioIo::new(upgraded), peer, "tcp").await,
                            Err(e) => tracing::debug!("HTTP/2 CONNECT upgrade: {e}"),
                        }
                    });
                    Ok(http::Response::new(empty))
                }
            });
        let served = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_concurrent_streams(strait_mesh::tunnel::quic::MAX_STREAMS_PER_CONNECTION)
            .initial_stream_window_size(strait_mesh::tunnel::quic::STREAM_WINDOW)
            .initial_connection_window_size(strait_mesh::tunnel::quic::CONNECTION_WINDOW)
            .keep_alive_interval(strait_mesh::tunnel::quic::KEEP_ALIVE)
            .keep_alive_timeout(strait_mesh::tunnel::quic::IDLE_TIMEOUT)
            .serve_connection(TokioIo::new(tls), service)
            .await;
        if let Err(e) = served {
            tracing::debug!("HTTP/2 fallback connection: {e}");
        }
    }

    /// One stream: header, checks, a tunnel to a pod, then bytes both ways.
    pub async fn stream<S>(self: Arc<Self>, mut stream: S, peer: SpiffeId, transport: &'static str)
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        self.active.fetch_add(1, Ordering::AcqRel);
        self.metrics.open_streams.inc();
        let _guard = StreamGuard(self.active.clone(), self.metrics.open_streams.clone());
        let header = match TunnelHeader::read_from(&mut stream, DEFAULT_READ_TIMEOUT).await {
            Ok(h) => h,
            Err(e) => {
                self.deny(&peer, "bad-header");
                if let Some(answer) = TunnelResponse::for_header_error(&e) {
                    let _ = answer.write_to(&mut stream).await;
                }
                tracing::debug!(%peer, "tunnel header: {e}");
                return;
            }
        };
        if let Target::Service { fqdn, .. } = &header.target
            && fqdn.as_str() == strait_mesh::tunnel::quic::PROBE_FQDN
        {
            // A probe (anyone under the anchor may ask): ready means synced.
            let answer = if self.discovery.is_synced() {
                TunnelResponse::ok()
            } else {
                TunnelResponse::refused(
                    ResponseStatus::TargetUnavailable,
                    "the gateway has not synced with its API server yet",
                )
            };
            self.metrics
                .probes
                .get_or_create(&TransportLabels {
                    transport: transport.into(),
                })
                .inc();
            let _ = answer.write_to(&mut stream).await;
            let _ = stream.shutdown().await;
            return;
        }
        match self.route(&header, &peer).await {
            Ok((tunnel, labels)) => {
                if TunnelResponse::ok().write_to(&mut stream).await.is_err() {
                    return;
                }
                let mut labels = labels;
                labels.transport = transport.into();
                self.metrics.streams.get_or_create(&labels).inc();
                let started = std::time::Instant::now();
                let mut tunnel = tunnel;
                // A stream lives as long as the caller keeps it (pooled HTTP
                // keeps it for many requests): when the Service stops being
                // exported or its policy stops allowing the caller, close it.
                let caller = header.source.clone().unwrap_or_else(|| peer.clone());
                let revoked = self.revoked(&caller, &header);
                tokio::select! {
                    copied = strait_mesh::io::splice(&mut stream, &mut tunnel) => {
                        let (up, down) = copied.unwrap_or((0, 0));
                        self.metrics
                            .stream_bytes
                            .get_or_create(&labels)
                            .inc_by(up + down);
                    }
                    why = revoked => {
                        self.deny(&caller, "revoked");
                        tracing::info!(%caller, "closing a stream: {why}");
                    }
                }
                self.metrics
                    .stream_duration
                    .get_or_create(&labels)
                    .observe(started.elapsed().as_secs_f64());
            }
            Err(refusal) => {
                self.deny(header.source.as_ref().unwrap_or(&peer), refusal.reason());
                if self.refusal_log.allow(&peer.to_string()) {
                    tracing::info!(%peer, source = ?header.source.as_ref().map(ToString::to_string), "refused: {refusal}");
                }
                let _ = TunnelResponse::refused(refusal.status(), refusal.to_string())
                    .write_to(&mut stream)
                    .await;
                let _ = stream.shutdown().await;
            }
        }
    }

    /// Resolves once `caller` may no longer use the Service `header` names.
    async fn revoked(&self, caller: &SpiffeId, header: &TunnelHeader) -> Revoked {
        let Target::Service { fqdn, port } = &header.target else {
            return std::future::pending().await;
        };
        let mut updates = self.discovery.updates();
        loop {
            if updates.changed().await.is_err() {
                return std::future::pending().await;
            }
            let snapshot = updates.borrow_and_update().clone();
            let fqdn = fqdn.as_str().to_string();
            match snapshot.resolve_name(&fqdn, *port) {
                None => return Revoked::Gone { fqdn },
                Some(d) if !d.exported => return Revoked::NotExported { fqdn },
                Some(d) if !policy::allowed(caller, d.allowed_identities.as_deref()) => {
                    return Revoked::NotAllowed {
                        caller: caller.clone(),
                        fqdn,
                    };
                }
                Some(_) => {}
            }
        }
    }

    fn deny(&self, caller: &SpiffeId, reason: &str) {
        self.metrics
            .denied
            .get_or_create(&DeniedLabels {
                reason: reason.into(),
                src_cluster: self.clusters.of(caller.trust_domain()).into(),
                src_trust_domain: caller.trust_domain().into(),
                dst_cluster: self.cluster.clone(),
            })
            .inc();
    }

    /// The checks, then a tunnel to a pod of the Service for the caller.
    async fn route(
        &self,
        header: &TunnelHeader,
        peer: &SpiffeId,
    ) -> Result<(strait_mesh::io::ClientTls, StreamLabels), Refusal> {
        let caller = match &header.source {
            Some(source) if policy::may_speak_for(peer, source) => source.clone(),
            Some(source) => {
                return Err(Refusal::SourceClaim {
                    peer: peer.clone(),
                    claimed: source.clone(),
                });
            }
            None => peer.clone(),
        };
        let Target::Service { fqdn, port } = &header.target else {
            return Err(Refusal::NotAService);
        };
        let Some(destination) = self.discovery.resolve_name(fqdn.as_str(), *port) else {
            return Err(Refusal::UnknownService {
                fqdn: fqdn.as_str().into(),
                port: *port,
                cluster: self.cluster.clone(),
            });
        };
        let service = destination
            .service
            .as_ref()
            .map(|s| ServiceName {
                namespace: s.namespace.clone(),
                name: s.name.clone(),
            })
            .unwrap_or_default();
        if !destination.exported {
            return Err(Refusal::NotExported {
                service,
                cluster: self.cluster.clone(),
            });
        }
        if !policy::allowed(&caller, destination.allowed_identities.as_deref()) {
            return Err(Refusal::Policy { caller, service });
        }
        let endpoints: Vec<_> = destination
            .endpoints
            .iter()
            .filter_map(|e| match &e.route {
                Route::NodeProxy {
                    proxy, identity, ..
                } => Some((e.addr, *proxy, identity.clone())),
                _ => None,
            })
            .collect();
        if endpoints.is_empty() {
            return Err(Refusal::NoEndpoints { service });
        }
        let labels = StreamLabels {
            transport: String::new(),
            src_cluster: self.clusters.of(caller.trust_domain()).into(),
            src_trust_domain: caller.trust_domain().into(),
            src_namespace: caller.namespace().into(),
            src_workload: caller.service_account().into(),
            dst_cluster: self.cluster.clone(),
            dst_namespace: service.namespace,
            dst_service: service.name,
        };
        // Round robin from a moving start; on a retryable failure, the next.
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let mut attempt = 0;
        loop {
            let (pod, node, identity) = &endpoints[(start + attempt) % endpoints.len()];
            attempt += 1;
            let config = self.config_for(identity)?;
            match open_to_pod(
                config,
                *node,
                *pod,
                identity,
                header.protocol,
                Some(caller.clone()),
                header.end_to_end,
            )
            .await
            {
                Ok(tunnel) => return Ok((tunnel, labels)),
                Err(e) if e.retryable() && attempt < endpoints.len() => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn config_for(&self, identity: &SpiffeId) -> Result<Arc<rustls::ClientConfig>, tls::TlsError> {
        let mut configs = self.configs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = configs.get(identity) {
            return Ok(found.clone());
        }
        let config = Arc::new(tls::client_config(
            &self.bundle,
            self.identity.cert(),
            vec![identity.clone()],
            &[TUNNEL_ALPN],
        )?);
        configs.insert(identity.clone(), config.clone());
        Ok(config)
    }
}

/// Closes QUIC connections once nothing arrived from their peer for the idle
/// timeout. QUIC's own idle timeout is at least three probe timeouts (RFC
/// 9000 §10.1), which an RTT inflated by load (a handshake flood) stretches
/// to tens of seconds; a live peer sends a keep-alive every second, so
/// silence this long means it is gone or hostile. One task looks at every
/// connection once a second (one timer, not one per idle connection).
#[derive(Default)]
struct Silence {
    watched: Mutex<HashMap<u64, Heard>>,
    next: std::sync::atomic::AtomicU64,
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What the sweeper knows of one connection.
struct Heard {
    connection: quinn::Connection,
    datagrams: u64,
    at: tokio::time::Instant,
}

/// Stops watching a connection when its task ends.
struct Watched(Arc<Silence>, u64);

impl Drop for Watched {
    fn drop(&mut self) {
        self.0
            .watched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.1);
    }
}

impl Silence {
    fn watch(self: &Arc<Self>, connection: &quinn::Connection) -> Watched {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let heard = Heard {
            connection: connection.clone(),
            datagrams: connection.stats().udp_rx.datagrams,
            at: tokio::time::Instant::now(),
        };
        self.watched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, heard);
        Watched(self.clone(), id)
    }

    async fn sweep(self: Arc<Self>) {
        let idle = strait_mesh::tunnel::quic::IDLE_TIMEOUT;
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = tokio::time::Instant::now();
            let mut watched = self.watched.lock().unwrap_or_else(|e| e.into_inner());
            watched.retain(|_, heard| {
                let datagrams = heard.connection.stats().udp_rx.datagrams;
                if datagrams != heard.datagrams {
                    (heard.datagrams, heard.at) = (datagrams, now);
                    return true;
                }
                if now.duration_since(heard.at) < idle {
                    return true;
                }
                tracing::debug!(remote = %heard.connection.remote_address(), "QUIC peer silent for {idle:?}: closed");
                heard.connection.close(0u32.into(), b"idle");
                false
            });
        }
    }
}

/// The SPIFFE ID of a QUIC peer.
fn quic_peer(connection: &quinn::Connection) -> Option<SpiffeId> {
    let certs = connection
        .peer_identity()?
        .downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
        .ok()?;
    tls::peer_identity(Some(certs.as_slice())).ok()
}
