//! The outbound side (port 4140): an HTTP proxy for the pods on this node
//! (`http_proxy` = the `strait-proxy` Service, `internalTrafficPolicy: Local`). Absolute-form HTTP/1 requests are balanced
//! per request over the destination's endpoints; `CONNECT host:port` carries
//! any TCP protocol to one endpoint. Either way the bytes travel to the node
//! proxy of the chosen endpoint over mutual TLS, where the calling pod's
//! identity meets the called pod's ([`crate::identity`]).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::client::ManagedIdentity;
use strait_mesh::identity::protocol::PodRef;
use strait_mesh::io::ClientTls;
use strait_mesh::tunnel::quic::{GatewayClient, GatewayStream};
use strait_mesh::tunnel::{Protocol, ResponseStatus, Target, TunnelHeader};
use tokio::net::{TcpListener, TcpStream};

use crate::Drain;
use crate::balance::Balancer;
use crate::detect::{DEFAULT_DETECT_TIMEOUT, OpaquePorts, PrefixedIo, detect};
use crate::identity::PodIdentities;
use crate::inbound::LocalPods;
use crate::metrics::{ProxyMetrics, TcpLabels};
use crate::retry::{BudgetConfig, RetryBudget};

/// One place a destination can be reached: a pod, the node proxy in front of
/// it, and the identity it runs as.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub addr: SocketAddr,
    pub node_proxy: SocketAddr,
    pub identity: SpiffeId,
    /// A mirror endpoint: `addr` is a remote cluster's gateway (and
    /// `identity` its identity); the stream names this Service (FQDN, port)
    /// there. `None`: a pod of this cluster behind `node_proxy`.
    pub remote: Option<(String, u16)>,
}

impl Endpoint {
    /// The pooling key: the pod's address, or for a mirror endpoint a name
    /// unique to (gateway, identity, remote Service), which several mirrors
    /// behind one gateway must not share.
    pub fn pool_key(&self) -> String {
        match &self.remote {
            None => self.addr.to_string(),
            Some((fqdn, port)) => {
                use std::hash::{Hash, Hasher};
                let mut h = std::collections::hash_map::DefaultHasher::new();
                (self.addr, &self.identity, fqdn, port).hash(&mut h);
                format!("{:016x}{GATEWAY_POOL_SUFFIX}:{port}", h.finish())
            }
        }
    }
}

/// Host suffix of the pooling keys of mirror endpoints.
const GATEWAY_POOL_SUFFIX: &str = ".gateway.strait.internal";

/// A tunnel: to a node proxy (TCP + TLS), or to a remote gateway (a QUIC
/// stream, or TCP + TLS on fallback).
pub enum TunnelStream {
    Node(Box<ClientTls>),
    Gateway(GatewayStream),
}

impl tokio::io::AsyncRead for TunnelStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            TunnelStream::Node(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            TunnelStream::Gateway(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for TunnelStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            TunnelStream::Node(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            TunnelStream::Gateway(s) => Pin::new(s).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            TunnelStream::Node(s) => Pin::new(s.as_mut()).poll_flush(cx),
            TunnelStream::Gateway(s) => Pin::new(s).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            TunnelStream::Node(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            TunnelStream::Gateway(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// Everything needed to open a tunnel to any endpoint for a caller.
#[derive(Clone)]
struct Opener {
    identities: Arc<PodIdentities>,
    configs: Arc<ConfigCache>,
    gateways: Option<Arc<GatewayClient>>,
}

impl Opener {
    async fn open(
        &self,
        source: &ManagedIdentity,
        endpoint: &Endpoint,
        protocol: Protocol,
    ) -> Result<TunnelStream, TunnelError> {
        match &endpoint.remote {
            None => {
                let config = self
                    .configs
                    .get(&self.identities, source, &endpoint.identity)?;
                let tls = open_tunnel(config, endpoint, protocol).await?;
                Ok(TunnelStream::Node(Box::new(tls)))
            }
            Some((fqdn, port)) => {
                let gateways = self.gateways.as_ref().ok_or_else(|| {
                    TunnelError::Config(
                        "no gateway client (the proxy has no identity of its own)".into(),
                    )
                })?;
                let target = Target::service(fqdn, *port)
                    .map_err(|e| TunnelError::Protocol(e.to_string(), endpoint.addr))?;
                let mut header = TunnelHeader::new(target, protocol);
                header.source = Some(source.id());
                let stream = gateways
                    .open(endpoint.addr, &endpoint.identity, &header)
                    .await?;
                Ok(TunnelStream::Gateway(stream))
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("{0} is not a known service: use <service>.<namespace>[.svc.<cluster-domain>]")]
    UnknownHost(String),
    #[error("service {0} has no ready endpoints")]
    NoEndpoints(String),
}

/// A destination as the outbound side uses it.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub endpoints: Vec<Endpoint>,
    /// Never protocol-detect connections to it (`strait.dev/opaque-ports`).
    pub opaque: bool,
    /// The whole request's deadline, retries included (`strait.dev/timeout`).
    pub timeout: Option<Duration>,
}

/// What the outbound side needs from discovery.
pub trait Destinations: LocalPods {
    /// The ready endpoints of `host:port` (a service name or a ClusterIP).
    fn resolve(&self, host: &str, port: u16) -> Result<Resolved, ResolveError>;
    /// The endpoint behind one pod address (to reconnect a pooled connection).
    fn endpoint(&self, addr: SocketAddr) -> Option<Endpoint>;
    /// The pod `namespace/name` if it runs on this node (a pod enrolled in
    /// transparent mode is known by name, not by source address).
    fn local_pod_named(&self, namespace: &str, name: &str) -> Option<crate::inbound::LocalPod>;
    /// Whether the pod `namespace/name` scheduled to this node asked for
    /// transparent mode; `None` when no such pod is scheduled here.
    fn transparent_wanted(&self, namespace: &str, name: &str) -> Option<bool>;
}

pub use strait_mesh::tunnel::client::TunnelError;
use strait_mesh::tunnel::client::{CONNECT_TIMEOUT, open_to_pod};

/// How long a pod may take to send a request head, and how long a kept-alive
/// connection may sit idle between requests (hyper's default, which needs a
/// timer to apply): a silent or trickling client cannot hold a connection.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// A connection's HTTP/1 read buffer and write buffer are each at most this
/// large; a longer request head is answered 431 and the connection closed.
/// (hyper's default is ~400 KiB; Envoy allows 60 KiB of headers.)
const MAX_BUF_SIZE: usize = 64 * 1024;

/// Opens a tunnel to `endpoint` as the caller the config presents: TCP to its
/// node proxy, mutual TLS (the server must be `endpoint.identity`), the
/// header, and the peer's answer. Returns the stream ready for app bytes.
pub async fn open_tunnel(
    config: Arc<rustls::ClientConfig>,
    endpoint: &Endpoint,
    protocol: Protocol,
) -> Result<ClientTls, TunnelError> {
    open_to_pod(
        config,
        endpoint.node_proxy,
        endpoint.addr,
        &endpoint.identity,
        protocol,
        None,
    )
    .await
}

/// Client configs by (source, destination), built once: building one
/// validates the trust anchors, too slow to do per connection.
#[derive(Default)]
struct ConfigCache(Mutex<HashMap<(SpiffeId, SpiffeId), Arc<rustls::ClientConfig>>>);

impl ConfigCache {
    fn get(
        &self,
        identities: &PodIdentities,
        source: &ManagedIdentity,
        destination: &SpiffeId,
    ) -> Result<Arc<rustls::ClientConfig>, TunnelError> {
        let key = (source.id(), destination.clone());
        if let Some(found) = self.0.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(found.clone());
        }
        let config = identities
            .client_config(source, destination.clone())
            .map_err(|e| TunnelError::Config(e.to_string()))?;
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, config.clone());
        Ok(config)
    }
}

type Body = BoxBody<Bytes, hyper::Error>;

pub struct Outbound {
    pub node: String,
    pub identities: Arc<PodIdentities>,
    pub destinations: Arc<dyn Destinations>,
    pub metrics: ProxyMetrics,
    pub balancer: Balancer,
    /// Opens tunnels (node proxies and gateways); shared with every pooling
    /// client's connector.
    opener: Opener,
    /// Mirror endpoints by pooling key, for the pooling clients' connectors.
    remote_routes: Arc<Mutex<HashMap<String, Endpoint>>>,
    /// One pooling HTTP/1 client per calling identity.
    clients: Mutex<HashMap<SpiffeId, Client<TunnelConnector, Body>>>,
    /// HTTP/2 connections (one multiplexed tunnel per caller and pod).
    h2: Mutex<HashMap<(SpiffeId, String), hyper::client::conn::http2::SendRequest<Body>>>,
    /// One retry budget per destination (`host:port` as the caller named it),
    /// shared by every worker thread's `Outbound`: the budget is the proxy's.
    budgets: Arc<Mutex<HashMap<String, Arc<RetryBudget>>>>,
}

/// Everything known about the pod that opened a connection to us.
#[derive(Clone)]
struct Caller {
    identity: Arc<ManagedIdentity>,
}

fn text(status: StatusCode, message: String) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "text/plain")
        .header("strait-proxy-error", message.replace(['\r', '\n'], " "))
        .body(
            Full::new(Bytes::from(message + "\n"))
                .map_err(|never| match never {})
                .boxed(),
        )
        .expect("static response parts are valid")
}

impl Outbound {
    pub fn new(
        node: &str,
        identities: Arc<PodIdentities>,
        destinations: Arc<dyn Destinations>,
        metrics: ProxyMetrics,
        gateways: Option<Arc<GatewayClient>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            node: node.to_string(),
            opener: Opener {
                identities: identities.clone(),
                configs: Arc::default(),
                gateways,
            },
            remote_routes: Arc::default(),
            identities,
            destinations,
            metrics,
            balancer: Balancer::default(),
            clients: Mutex::new(HashMap::new()),
            h2: Mutex::new(HashMap::new()),
            budgets: Arc::default(),
        })
    }

    /// The `Outbound` of another worker thread (`--runtime=per-core`): the
    /// same identities, destinations, metrics, gateway client and retry
    /// budgets; its own balancer statistics, pools and TLS configs, so a
    /// request never touches another thread's connections.
    pub fn worker(&self) -> Arc<Self> {
        Arc::new(Self {
            node: self.node.clone(),
            opener: Opener {
                identities: self.identities.clone(),
                configs: Arc::default(),
                gateways: self.opener.gateways.clone(),
            },
            remote_routes: Arc::default(),
            identities: self.identities.clone(),
            destinations: self.destinations.clone(),
            metrics: self.metrics.clone(),
            balancer: Balancer::default(),
            clients: Mutex::new(HashMap::new()),
            h2: Mutex::new(HashMap::new()),
            budgets: self.budgets.clone(),
        })
    }

    /// Serves the node's pods until the drain starts.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, drain: Drain) {
        let draining = drain.clone();
        crate::serve_connections(listener, drain, "outbound", move |stream, peer| {
            self.clone().handle(stream, peer, draining.clone())
        })
        .await
    }

    /// One pod's connection. When the drain starts, a request in flight is
    /// answered and then the connection closes (an idle keep-alive connection
    /// closes at once), so pooling clients do not hold the drain open.
    async fn handle(self: Arc<Self>, stream: TcpStream, peer: SocketAddr, drain: Drain) {
        let caller = self.caller(peer.ip()).await;
        let this = self.clone();
        let tunnels = drain.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let (this, caller, tunnels) = (this.clone(), caller.clone(), tunnels.clone());
            async move {
                let connect = req.method() == http::Method::CONNECT;
                let mut response = match caller {
                    Ok(caller) => this.route(req, caller, &tunnels).await,
                    Err(message) => text(StatusCode::FORBIDDEN, message),
                };
                // An accepted CONNECT becomes the tunnel: nothing to close.
                if !(connect && response.status().is_success()) {
                    tunnels.mark_closing(&mut response);
                }
                Ok::<_, Infallible>(response)
            }
        });
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .max_buf_size(MAX_BUF_SIZE)
            .serve_connection(TokioIo::new(stream), service)
            .with_upgrades();
        tokio::pin!(connection);
        let served = tokio::select! {
            served = connection.as_mut() => served,
            _ = drain.signaled() => {
                connection.as_mut().graceful_shutdown();
                connection.await
            }
        };
        if let Err(e) = served {
            tracing::debug!(%peer, "outbound connection: {e}");
        }
    }

    /// A connection a pod enrolled in transparent mode opened to anywhere,
    /// redirected here by its network namespace's rules: the original
    /// destination (SO_ORIGINAL_DST) says where it was going. A Service or pod
    /// of the mesh is detected (unless its port is opaque) and carried like
    /// the HTTP proxy's traffic; anything else passes through unchanged.
    pub async fn handle_transparent(
        self: Arc<Self>,
        mut stream: TcpStream,
        namespace: String,
        name: String,
        drain: Drain,
    ) {
        let original = match socket2::SockRef::from(&stream).original_dst_v4() {
            Ok(addr) => addr.as_socket(),
            Err(e) => {
                tracing::debug!("transparent: no original destination ({e}): closing");
                None
            }
        };
        let Some(original) = original else { return };
        let resolved = match self
            .destinations
            .resolve(&original.ip().to_string(), original.port())
        {
            Ok(r) => r,
            Err(ResolveError::UnknownHost(_)) => return passthrough(stream, original).await,
            Err(e) => {
                tracing::debug!(pod = %format!("{namespace}/{name}"), "transparent: {e}: closing");
                return;
            }
        };
        let caller = match self.caller_named(&namespace, &name).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("transparent: {e}: closing");
                return;
            }
        };
        let opaque = resolved.opaque || OpaquePorts::defaults().contains(original.port());
        let (protocol, prefix) = if opaque {
            (Protocol::Opaque, Bytes::new())
        } else {
            match detect(&mut stream, DEFAULT_DETECT_TIMEOUT).await {
                Ok(found) => found,
                Err(e) => {
                    tracing::debug!(%original, "transparent: reading the first bytes: {e}");
                    return;
                }
            }
        };
        let io = PrefixedIo::new(prefix, stream);
        match protocol {
            Protocol::Opaque => {
                match self
                    .open_any(&caller, &resolved.endpoints, Protocol::Opaque)
                    .await
                {
                    Ok((tunnel, endpoint)) => {
                        let labels = TcpLabels::outbound(&caller.identity.id(), &endpoint.identity);
                        splice(&self.metrics, &labels, io, tunnel).await;
                    }
                    Err(e) => tracing::debug!(
                        %original,
                        "transparent: no tunnel: {}",
                        e.map_or("no endpoint".to_string(), |e| e.to_string())
                    ),
                }
            }
            Protocol::Http1 | Protocol::Http2 => {
                let this = self.clone();
                let http1 = protocol == Protocol::Http1;
                let closing = drain.clone();
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let (this, caller, closing) = (this.clone(), caller.clone(), closing.clone());
                    async move {
                        // Endpoints change under a long-lived connection: ask per request.
                        let mut response = match this
                            .destinations
                            .resolve(&original.ip().to_string(), original.port())
                        {
                            Ok(resolved) => {
                                this.forward_within(req, caller, resolved, &original.to_string())
                                    .await
                            }
                            Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                        };
                        if http1 {
                            closing.mark_closing(&mut response);
                        }
                        Ok::<_, Infallible>(response)
                    }
                });
                // The HTTP proxy's limits; on drain, finish what is in flight.
                let io = TokioIo::new(io);
                let served = if protocol == Protocol::Http2 {
                    let connection = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .timer(TokioTimer::new())
                        .serve_connection(io, service);
                    tokio::pin!(connection);
                    tokio::select! {
                        served = connection.as_mut() => served,
                        _ = drain.signaled() => {
                            connection.as_mut().graceful_shutdown();
                            connection.await
                        }
                    }
                } else {
                    let connection = hyper::server::conn::http1::Builder::new()
                        .timer(TokioTimer::new())
                        .header_read_timeout(HEADER_READ_TIMEOUT)
                        .max_buf_size(MAX_BUF_SIZE)
                        .serve_connection(io, service)
                        .with_upgrades();
                    tokio::pin!(connection);
                    tokio::select! {
                        served = connection.as_mut() => served,
                        _ = drain.signaled() => {
                            connection.as_mut().graceful_shutdown();
                            connection.await
                        }
                    }
                };
                if let Err(e) = served {
                    tracing::debug!(%original, "transparent connection: {e}");
                }
            }
        }
    }

    /// The calling pod, which must run on this node, and its identity.
    async fn caller(&self, ip: IpAddr) -> Result<Caller, String> {
        let pod = self.destinations.local_pod(ip).ok_or_else(|| {
            format!(
                "{ip} is not a pod on node {}: the node proxy serves only this node's pods, \
                 known by their own source address; if a pod of this node sent this, its \
                 address was rewritten on the way (e.g. a hostPort through the CNI portmap \
                 plugin masquerades same-node callers unless its \"snat\" is false): reach the \
                 proxy through the strait-proxy Service (internalTrafficPolicy: Local) or \
                 transparent mode instead",
                self.node
            )
        })?;
        self.caller_for(pod).await
    }

    /// A pod enrolled in transparent mode, by name.
    async fn caller_named(&self, namespace: &str, name: &str) -> Result<Caller, String> {
        let pod = self
            .destinations
            .local_pod_named(namespace, name)
            .ok_or_else(|| {
                format!(
                    "pod {namespace}/{name} is not known to run on node {}",
                    self.node
                )
            })?;
        self.caller_for(pod).await
    }

    async fn caller_for(&self, pod: crate::inbound::LocalPod) -> Result<Caller, String> {
        let pod_ref = PodRef {
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
        };
        let identity = self
            .identities
            .for_pod(&pod_ref, &pod.service_account)
            .await
            .map_err(|e| format!("no identity for pod {}/{}: {e}", pod.namespace, pod.name))?;
        Ok(Caller { identity })
    }

    async fn route(&self, req: Request<Incoming>, caller: Caller, drain: &Drain) -> Response<Body> {
        let target = if req.method() == http::Method::CONNECT {
            req.uri().authority().cloned()
        } else {
            req.uri().authority().cloned().or_else(|| {
                req.headers()
                    .get(http::header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .and_then(|h| h.parse().ok())
            })
        };
        let Some(authority) = target else {
            return text(
                StatusCode::BAD_REQUEST,
                "no destination: send absolute-form requests (http_proxy) or CONNECT host:port"
                    .into(),
            );
        };
        let default_port = if req.method() == http::Method::CONNECT {
            443
        } else {
            80
        };
        let port = authority.port_u16().unwrap_or(default_port);
        let resolved = match self.destinations.resolve(authority.host(), port) {
            Ok(r) => r,
            Err(e @ ResolveError::UnknownHost(_)) => {
                return text(StatusCode::NOT_FOUND, e.to_string());
            }
            Err(e) => return text(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        if req.method() == http::Method::CONNECT {
            self.connect(req, caller, resolved.endpoints, drain).await
        } else {
            let destination = format!("{}:{port}", authority.host());
            self.forward_within(req, caller, resolved, &destination)
                .await
        }
    }

    /// [`Self::forward`] within the destination's timeout (`strait.dev/timeout`).
    async fn forward_within(
        &self,
        req: Request<Incoming>,
        caller: Caller,
        resolved: Resolved,
        destination: &str,
    ) -> Response<Body> {
        let forward = self.forward(req, caller, resolved.endpoints, destination);
        match resolved.timeout {
            None => forward.await,
            Some(limit) => match tokio::time::timeout(limit, forward).await {
                Ok(response) => response,
                Err(_) => text(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!(
                        "{destination} did not answer within its timeout of {limit:?} (strait.dev/timeout)"
                    ),
                ),
            },
        }
    }

    /// CONNECT: open the tunnel first (so failures are a 502, not a reset),
    /// then answer 200 and splice. The splice outlives the HTTP connection
    /// (hyper hands the bytes over), so it holds a drain guard of its own.
    async fn connect(
        &self,
        req: Request<Incoming>,
        caller: Caller,
        endpoints: Vec<Endpoint>,
        drain: &Drain,
    ) -> Response<Body> {
        match self.open_any(&caller, &endpoints, Protocol::Opaque).await {
            Ok((tunnel, endpoint)) => {
                let labels = TcpLabels::outbound(&caller.identity.id(), &endpoint.identity);
                let metrics = self.metrics.clone();
                let guard = drain.guard();
                tokio::spawn(async move {
                    let _guard = guard;
                    let Ok(upgraded) = hyper::upgrade::on(req).await else {
                        return;
                    };
                    splice(&metrics, &labels, TokioIo::new(upgraded), tunnel).await;
                });
                Response::new(
                    http_body_util::Empty::new()
                        .map_err(|never| match never {})
                        .boxed(),
                )
            }
            Err(Some(e)) => text(status_for(&e), e.to_string()),
            Err(None) => text(StatusCode::BAD_GATEWAY, "no endpoint".into()),
        }
    }

    /// A tunnel to one of `endpoints`, best first by the balancer, moving on
    /// while failures are retryable. `Err(None)`: no endpoint at all.
    async fn open_any(
        &self,
        caller: &Caller,
        endpoints: &[Endpoint],
        protocol: Protocol,
    ) -> Result<(TunnelStream, Endpoint), Option<TunnelError>> {
        let mut last_error = None;
        for endpoint in self.balancer.order(endpoints) {
            match self
                .opener
                .open(&caller.identity, &endpoint, protocol)
                .await
            {
                Ok(tunnel) => return Ok((tunnel, endpoint)),
                Err(e) if e.retryable() => {
                    tracing::debug!(endpoint = %endpoint.addr, "{e}; trying another endpoint");
                    last_error = Some(e);
                }
                Err(e) => return Err(Some(e)),
            }
        }
        Err(last_error)
    }

    /// An HTTP request (absolute-form HTTP/1 from the HTTP proxy, or any
    /// HTTP/1 or HTTP/2 request in transparent mode): pick an endpoint for
    /// this request and send it over a pooled tunnel to that pod, in the
    /// version the client spoke (HTTP/2 stays HTTP/2 end to end: gRPC). A retryable failure (the
    /// request never reached a pod, or a bodiless idempotent request answered
    /// 502/503/504) is sent again to another endpoint while the destination's
    /// retry budget allows.
    async fn forward(
        &self,
        req: Request<Incoming>,
        caller: Caller,
        endpoints: Vec<Endpoint>,
        destination: &str,
    ) -> Response<Body> {
        let (mut parts, body) = req.into_parts();
        let http2 = parts.version == http::Version::HTTP_2;
        crate::hop::strip(&mut parts.headers);
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_string();
        // Only a request without a body can be sent twice (nothing to buffer).
        let replayable = hyper::body::Body::is_end_stream(&body) && is_idempotent(&parts.method);
        let mut body = Some(body.boxed());
        let budget = self.budget_for(destination);
        budget.deposit(Instant::now());
        let source = caller.identity.id();
        let mut tried: Vec<SocketAddr> = Vec::new();
        let mut attempt = 0;
        loop {
            attempt += 1;
            // A retry goes elsewhere if it can.
            let candidates: Vec<Endpoint> = if tried.is_empty() {
                Vec::new()
            } else {
                endpoints
                    .iter()
                    .filter(|e| !tried.contains(&e.addr))
                    .cloned()
                    .collect()
            };
            let Some(endpoint) = self.balancer.pick(if candidates.is_empty() {
                &endpoints
            } else {
                &candidates
            }) else {
                return text(StatusCode::SERVICE_UNAVAILABLE, "no ready endpoint".into());
            };
            tried.push(endpoint.addr);
            let series = self.metrics.outbound_http(&source, &endpoint.identity);
            // HTTP/1: the pool is keyed by the pod's address (kept-alive
            // tunnels per pod; the Host header still names the service).
            // HTTP/2 keeps the client's URI: it carries `:authority`.
            let uri = if http2 && parts.uri.authority().is_some() {
                parts.uri.clone()
            } else {
                let key = endpoint.pool_key();
                if endpoint.remote.is_some() {
                    self.remote_routes
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(key.clone(), endpoint.clone());
                }
                match Uri::builder()
                    .scheme("http")
                    .authority(key)
                    .path_and_query(path.as_str())
                    .build()
                {
                    Ok(u) => u,
                    Err(e) => {
                        return text(StatusCode::BAD_REQUEST, format!("bad request target: {e}"));
                    }
                }
            };
            let mut request = Request::new(body.take().unwrap_or_else(empty_body));
            *request.method_mut() = parts.method.clone();
            *request.uri_mut() = uri;
            *request.version_mut() = parts.version;
            // Only a replayable request can be sent again: keep its headers.
            *request.headers_mut() = if replayable {
                parts.headers.clone()
            } else {
                std::mem::take(&mut parts.headers)
            };
            series.request();
            let started = Instant::now();
            let guard = self.balancer.start(&endpoint);
            let result = if http2 {
                self.send_h2(&caller, &endpoint, request).await
            } else {
                let mut request = request;
                // Only a gateway's connection may be a TCP fallback to retire.
                let captured = endpoint
                    .remote
                    .is_some()
                    .then(|| hyper_util::client::legacy::connect::capture_connection(&mut request));
                let result = self
                    .client_for(&caller, &source)
                    .request(request)
                    .await
                    .map_err(SendError::from);
                if let Some(captured) = captured {
                    self.retire_fallback(&endpoint, &captured);
                }
                result
            };
            let elapsed = started.elapsed();
            let retryable = match &result {
                Ok(r) => replayable && RETRYABLE_STATUSES.contains(&r.status()),
                // Never sent (no tunnel): safe to send elsewhere.
                Err(e) => e.connect && replayable,
            };
            guard.finish(elapsed, !retryable && result.is_ok());
            series.response(
                result.as_ref().ok().map(|r| r.status()),
                elapsed.as_secs_f64(),
            );
            if retryable && attempt < MAX_ATTEMPTS {
                if budget.withdraw(Instant::now()) {
                    series.retry();
                    tracing::debug!(endpoint = %endpoint.addr, attempt, "retrying on another endpoint");
                    continue;
                }
                series.budget_exhausted();
            }
            return match result {
                Ok(mut response) => {
                    crate::hop::strip(response.headers_mut());
                    response.map(|b| b.boxed())
                }
                Err(e) => {
                    tracing::info!(endpoint = %endpoint.addr, attempt, error = %e.message, "request failed: 502");
                    text(
                        StatusCode::BAD_GATEWAY,
                        format!("to {}: {}", endpoint.addr, e.message),
                    )
                }
            };
        }
    }

    /// A pooled TCP fallback stream to a gateway is not reused once QUIC
    /// works again (asking also starts the background QUIC attempt).
    fn retire_fallback(
        &self,
        endpoint: &Endpoint,
        captured: &hyper_util::client::legacy::connect::CaptureConnection,
    ) {
        let (Some(_), Some(gateways)) = (&endpoint.remote, &self.opener.gateways) else {
            return;
        };
        let metadata = captured.connection_metadata();
        let Some(connected) = metadata.as_ref() else {
            return;
        };
        let mut extras = http::Extensions::new();
        connected.get_extras(&mut extras);
        if extras.get::<FallbackTcp>().is_some()
            && gateways.prefers_quic(endpoint.addr, &endpoint.identity)
        {
            connected.poison();
        }
    }

    /// Sends an HTTP/2 request over the caller's multiplexed tunnel to the
    /// pod, opening it (or replacing a closed one) first.
    async fn send_h2(
        &self,
        caller: &Caller,
        endpoint: &Endpoint,
        request: Request<Body>,
    ) -> Result<Response<Incoming>, SendError> {
        let key = (caller.identity.id(), endpoint.pool_key());
        let existing = self
            .h2
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .filter(|s| !s.is_closed())
            .cloned();
        let mut sender = match existing {
            Some(sender) => sender,
            None => {
                let tunnel = self
                    .opener
                    .open(&caller.identity, endpoint, Protocol::Http2)
                    .await
                    .map_err(SendError::connect)?;
                let (sender, connection) =
                    hyper::client::conn::http2::Builder::new(TokioExecutor::new())
                        .handshake(TokioIo::new(tunnel))
                        .await
                        .map_err(SendError::connect)?;
                let pod = endpoint.addr;
                tokio::spawn(async move {
                    if let Err(e) = connection.await {
                        tracing::debug!(%pod, "HTTP/2 tunnel: {e}");
                    }
                });
                self.h2
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key, sender.clone());
                sender
            }
        };
        sender.ready().await.map_err(SendError::connect)?;
        sender.send_request(request).await.map_err(|e| SendError {
            connect: false,
            message: e.to_string(),
        })
    }

    /// Forgets HTTP/2 tunnels to pods that are gone (bounded memory).
    pub fn retain_h2(&self, keep: impl Fn(SocketAddr) -> bool) {
        let keep = |addr: SocketAddr| keep(addr);
        self.h2
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(_, key), sender| {
                key.parse::<SocketAddr>().map_or(true, &keep) && !sender.is_closed()
            });
    }

    fn budget_for(&self, destination: &str) -> Arc<RetryBudget> {
        let mut budgets = self.budgets.lock().unwrap_or_else(|e| e.into_inner());
        get_or_insert(&mut budgets, destination, || {
            Arc::new(RetryBudget::new(BudgetConfig::default()))
        })
    }

    fn client_for(&self, caller: &Caller, id: &SpiffeId) -> Client<TunnelConnector, Body> {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        get_or_insert(&mut clients, id, || {
            let connector = TunnelConnector {
                source: caller.identity.clone(),
                destinations: self.destinations.clone(),
                opener: self.opener.clone(),
                remote_routes: self.remote_routes.clone(),
            };
            Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(90))
                .pool_max_idle_per_host(1024)
                .build(connector)
        })
    }
}

/// The value under `key`, made and inserted first if there is none; the
/// key is copied only then (these lookups run per request).
fn get_or_insert<K, Q, V>(map: &mut HashMap<K, V>, key: &Q, make: impl FnOnce() -> V) -> V
where
    K: std::borrow::Borrow<Q> + std::hash::Hash + Eq,
    Q: ToOwned<Owned = K> + std::hash::Hash + Eq + ?Sized,
    V: Clone,
{
    if let Some(value) = map.get(key) {
        return value.clone();
    }
    map.entry(key.to_owned()).or_insert_with(make).clone()
}

/// Why a request got no response, and whether it never left (safe to send
/// to another endpoint).
#[derive(Debug)]
struct SendError {
    connect: bool,
    message: String,
}

impl SendError {
    fn connect(e: impl std::fmt::Display) -> Self {
        Self {
            connect: true,
            message: e.to_string(),
        }
    }
}

impl From<hyper_util::client::legacy::Error> for SendError {
    fn from(e: hyper_util::client::legacy::Error) -> Self {
        let message =
            std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| format!("{e}: {s}"));
        Self {
            connect: e.is_connect(),
            message,
        }
    }
}

/// Copies both ways between a client and a tunnel, counted as one TCP
/// connection in the metrics.
async fn splice<C, T>(metrics: &ProxyMetrics, labels: &TcpLabels, mut client: C, mut tunnel: T)
where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    metrics.tcp_open(labels);
    let (read, written) = strait_mesh::io::splice(&mut client, &mut tunnel)
        .await
        .unwrap_or((0, 0));
    metrics.tcp_close(labels, read, written);
}

/// A connection to something outside the mesh: connected from the node, as
/// the pod would have.
async fn passthrough(mut stream: TcpStream, original: SocketAddr) {
    match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(original)).await {
        Ok(Ok(mut upstream)) => {
            let _ = upstream.set_nodelay(true);
            let _ = strait_mesh::io::splice(&mut stream, &mut upstream).await;
        }
        Ok(Err(e)) => tracing::debug!(%original, "passthrough: {e}"),
        Err(_) => tracing::debug!(%original, "passthrough: connect timed out"),
    }
}

/// Attempts per request, the first included.
const MAX_ATTEMPTS: u32 = 3;
/// Answers that mean "this endpoint could not serve it; another may".
const RETRYABLE_STATUSES: [StatusCode; 3] = [
    StatusCode::BAD_GATEWAY,
    StatusCode::SERVICE_UNAVAILABLE,
    StatusCode::GATEWAY_TIMEOUT,
];

fn is_idempotent(method: &http::Method) -> bool {
    use http::Method;
    [
        Method::GET,
        Method::HEAD,
        Method::OPTIONS,
        Method::PUT,
        Method::DELETE,
        Method::TRACE,
    ]
    .contains(method)
}

fn empty_body() -> Body {
    http_body_util::Empty::new()
        .map_err(|never| match never {})
        .boxed()
}

fn status_for(e: &TunnelError) -> StatusCode {
    match e {
        TunnelError::Refused {
            status: ResponseStatus::Denied,
            ..
        } => StatusCode::FORBIDDEN,
        _ => StatusCode::BAD_GATEWAY,
    }
}

/// Connects the pooling HTTP client to a pod: the URI's authority is the pod's
/// address; the connection is a tunnel to the pod's node proxy.
#[derive(Clone)]
struct TunnelConnector {
    source: Arc<ManagedIdentity>,
    destinations: Arc<dyn Destinations>,
    opener: Opener,
    remote_routes: Arc<Mutex<HashMap<String, Endpoint>>>,
}

impl tower_service::Service<Uri> for TunnelConnector {
    type Response = TunnelIo;
    type Error = TunnelError;
    type Future = Pin<Box<dyn Future<Output = Result<TunnelIo, TunnelError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let authority = uri.authority().map(|a| a.as_str().to_string());
            let remote = authority.as_ref().and_then(|a| {
                this.remote_routes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(a)
                    .cloned()
            });
            let endpoint = match remote {
                Some(endpoint) => endpoint,
                None => {
                    let addr: SocketAddr = authority
                        .as_deref()
                        .and_then(|a| a.parse().ok())
                        .ok_or_else(|| {
                            TunnelError::Protocol(
                                format!("not a pod address: {uri}"),
                                "0.0.0.0:0".parse().expect("valid"),
                            )
                        })?;
                    this.destinations
                        .endpoint(addr)
                        .ok_or_else(|| TunnelError::Refused {
                            node: addr,
                            target: addr.to_string(),
                            status: ResponseStatus::NotFound,
                            message: "the pod is gone".into(),
                        })?
                }
            };
            let stream = this
                .opener
                .open(&this.source, &endpoint, Protocol::Http1)
                .await?;
            Ok(TunnelIo(TokioIo::new(stream)))
        })
    }
}

/// A tunnel as the pooling client sees it.
pub struct TunnelIo(TokioIo<TunnelStream>);

/// Marks a pooled connection that is a TCP fallback stream to a gateway.
#[derive(Clone, Copy, Debug)]
struct FallbackTcp;

impl Connection for TunnelIo {
    fn connected(&self) -> Connected {
        match self.0.inner() {
            TunnelStream::Gateway(s) if s.transport() == "tcp" => {
                Connected::new().extra(FallbackTcp)
            }
            _ => Connected::new(),
        }
    }
}

impl hyper::rt::Read for TunnelIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for TunnelIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
