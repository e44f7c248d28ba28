//! The outbound side (port 4140): an HTTP proxy for the pods on this node
//! (`http_proxy` = the `strait-proxy` Service, `internalTrafficPolicy:
//! Local`). Absolute-form HTTP/1 requests are balanced per request over the
//! destination's endpoints ([`forward`]); `CONNECT host:port` carries any TCP
//! protocol to one endpoint. Either way the bytes travel to the node proxy of
//! the chosen endpoint over mutual TLS ([`pool`]), where the calling pod's
//! identity meets the called pod's ([`crate::identity`]). Connections of pods
//! in transparent mode arrive redirected ([`redirect`]).

mod forward;
pub mod pool;
mod redirect;

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioIo, TokioTimer};
use strait_mesh::identity::client::{IssueError, ManagedIdentity};
use strait_mesh::identity::protocol::PodRef;
use strait_mesh::tunnel::client::TunnelError;
use strait_mesh::tunnel::{Protocol, ResponseStatus};
use tokio::net::{TcpListener, TcpStream};

use crate::balance::Balancer;
use crate::drain::{Drain, serve_connections};
use crate::identity::PodIdentities;
use crate::metrics::{ProxyMetrics, TcpLabels};
use crate::retry::RetryBudget;
use crate::view::{Destinations, Endpoint, LocalPod, ResolveError};
use pool::{EndpointConnector, H2Slot, Opener, PoolKey, Pools, TunnelStream};
use strait_mesh::limits::ConnLimit;

/// How long a pod may take to send a request head, and how long a kept-alive
/// connection may sit idle between requests (hyper's default, which needs a
/// timer to apply): a silent or trickling client cannot hold a connection.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// A connection's HTTP/1 read buffer and write buffer are each at most this
/// large; a longer request head is answered 431 and the connection closed.
/// (hyper's default is ~400 KiB; Envoy allows 60 KiB of headers.)
const MAX_BUF_SIZE: usize = 64 * 1024;
/// How long a pooled HTTP/1 tunnel may sit idle before it is closed; a pool
/// unused for this long is forgotten.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

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
    /// Pooling HTTP/1 clients, one per caller and endpoint.
    http1: Pools<Client<EndpointConnector, Body>>,
    /// HTTP/2 connections (one multiplexed tunnel per caller and endpoint).
    http2: Pools<H2Slot<Body>>,
    /// HTTP/1 callers' requests as HTTP/2 (one multiplexed tunnel per caller
    /// and endpoint, HTTP/1 again at the pod), with [`Http1Tunnels::Multiplexed`].
    http1_multiplexed: Pools<H2Slot<Body>>,
    http1_tunnels: Http1Tunnels,
    /// Hops (node proxies, gateways) that refused a multiplexed tunnel (a
    /// version that predates it), until when they get per-connection tunnels.
    per_connection_until: Arc<Mutex<std::collections::HashMap<std::net::SocketAddr, Instant>>>,
    /// One retry budget per destination (`host:port` as the caller named it),
    /// shared by every worker thread's `Outbound`: the budget is the proxy's.
    budgets: Arc<Mutex<std::collections::HashMap<String, Arc<RetryBudget>>>>,
}

/// How HTTP/1 callers' requests travel between node proxies (and through
/// gateways).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Http1Tunnels {
    /// One tunnel per pooled HTTP/1 connection.
    #[default]
    PerConnection,
    /// HTTP/2 streams over one tunnel per caller and endpoint; HTTP/1 again
    /// from the receiving node proxy to the pod.
    Multiplexed,
}

/// What a pod's connection past the outbound port's connection limit reads
/// before it is closed.
const REFUSED: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n\
strait-proxy-error: the node proxy holds its maximum of connections (--max-connections)\r\n\
connection: close\r\ncontent-length: 67\r\n\r\n\
the node proxy holds its maximum of connections (--max-connections)";

/// The pod that opened a connection to us, with its identity.
#[derive(Clone)]
struct Caller {
    identity: Arc<ManagedIdentity>,
}

/// A plain-text answer of the proxy itself, its reason also in the
/// `strait-proxy-error` header.
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

fn empty_body() -> Body {
    http_body_util::Empty::new()
        .map_err(|never| match never {})
        .boxed()
}

/// Why a connection's caller is not served.
#[derive(Debug, thiserror::Error)]
pub enum CallerError {
    #[error(
        "{ip} is not a pod on node {node}: the node proxy serves only this node's pods, known by their own source address; if a pod of this node sent this, its address was rewritten on the way (e.g. a hostPort through the CNI portmap plugin masquerades same-node callers unless its \"snat\" is false): reach the proxy through the strait-proxy Service (internalTrafficPolicy: Local) or transparent mode instead"
    )]
    NotOnNode { ip: IpAddr, node: String },
    #[error("pod {namespace}/{name} is not known to run on node {node}")]
    UnknownPod {
        namespace: String,
        name: String,
        node: String,
    },
    #[error("no identity for pod {namespace}/{name}: {source}")]
    NoIdentity {
        namespace: String,
        name: String,
        source: IssueError,
    },
}

impl Outbound {
    pub fn new(
        node: &str,
        identities: Arc<PodIdentities>,
        destinations: Arc<dyn Destinations>,
        metrics: ProxyMetrics,
        gateways: Option<Arc<strait_mesh::tunnel::quic::GatewayClient>>,
        http1_tunnels: Http1Tunnels,
    ) -> Arc<Self> {
        Arc::new(Self {
            node: node.to_string(),
            opener: Opener::new(identities.clone(), gateways),
            identities,
            destinations,
            metrics,
            balancer: Balancer::default(),
            http1: Pools::default(),
            http2: Pools::default(),
            http1_multiplexed: Pools::default(),
            http1_tunnels,
            per_connection_until: Arc::default(),
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
            opener: self.opener.worker(),
            identities: self.identities.clone(),
            destinations: self.destinations.clone(),
            metrics: self.metrics.clone(),
            balancer: Balancer::default(),
            http1: Pools::default(),
            http2: Pools::default(),
            http1_multiplexed: Pools::default(),
            http1_tunnels: self.http1_tunnels,
            per_connection_until: self.per_connection_until.clone(),
            budgets: self.budgets.clone(),
        })
    }

    /// Forgets what is kept per endpoint for endpoints `keep` refuses (pods
    /// that are gone), and pools unused for longer than their idle timeout:
    /// the maps stay bounded by what is in use.
    pub fn retain_endpoints(&self, keep: impl Fn(&Endpoint) -> bool) {
        let now = Instant::now();
        self.http1.retain(|e, _| keep(e), POOL_IDLE_TIMEOUT, now);
        for pools in [&self.http2, &self.http1_multiplexed] {
            pools.retain(
                |e, slot| keep(e) && pool::slot_in_use(slot),
                POOL_IDLE_TIMEOUT,
                now,
            );
        }
    }

    /// Serves the node's pods until the drain starts.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, drain: Drain, limit: ConnLimit) {
        let draining = drain.clone();
        serve_connections(
            listener,
            drain,
            "outbound",
            limit,
            REFUSED,
            move |stream, peer| self.clone().handle(stream, peer, draining.clone()),
        )
        .await
    }

    /// One pod's connection. When the drain starts, a request in flight is
    /// answered and then the connection closes (an idle keep-alive connection
    /// closes at once), so pooling clients do not hold the drain open.
    async fn handle(self: Arc<Self>, stream: TcpStream, peer: SocketAddr, drain: Drain) {
        // The refusal is every request's answer: kept as its text.
        let caller = self.caller(peer.ip()).await.map_err(|e| e.to_string());
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
        let connection = http1_server()
            .serve_connection(TokioIo::new(stream), service)
            .with_upgrades();
        let served = drain
            .serve(std::pin::pin!(connection), |c| c.graceful_shutdown())
            .await;
        if let Err(e) = served {
            tracing::debug!(%peer, "outbound connection: {e}");
        }
    }

    /// The calling pod, which must run on this node, and its identity.
    async fn caller(&self, ip: IpAddr) -> Result<Caller, CallerError> {
        let pod = self
            .destinations
            .local_pod(ip)
            .ok_or_else(|| CallerError::NotOnNode {
                ip,
                node: self.node.clone(),
            })?;
        self.caller_for(pod).await
    }

    /// A pod enrolled in transparent mode, by name.
    async fn caller_named(&self, namespace: &str, name: &str) -> Result<Caller, CallerError> {
        let pod = self
            .destinations
            .local_pod_named(namespace, name)
            .ok_or_else(|| CallerError::UnknownPod {
                namespace: namespace.into(),
                name: name.into(),
                node: self.node.clone(),
            })?;
        self.caller_for(pod).await
    }

    async fn caller_for(&self, pod: LocalPod) -> Result<Caller, CallerError> {
        let pod_ref = PodRef {
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
        };
        let identity = self
            .identities
            .for_pod(&pod_ref, &pod.service_account)
            .await
            .map_err(|source| CallerError::NoIdentity {
                namespace: pod.namespace,
                name: pod.name,
                source,
            })?;
        Ok(Caller { identity })
    }

    async fn route(&self, req: Request<Incoming>, caller: Caller, drain: &Drain) -> Response<Body> {
        let connect = req.method() == http::Method::CONNECT;
        let target = if connect {
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
        let port = authority
            .port_u16()
            .unwrap_or(if connect { 443 } else { 80 });
        let resolved = match self.destinations.resolve(authority.host(), port) {
            Ok(r) => r,
            Err(e @ ResolveError::UnknownHost(_)) => {
                return text(StatusCode::NOT_FOUND, e.to_string());
            }
            Err(e) => return text(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        if connect {
            self.connect(req, caller, resolved.endpoints, drain).await
        } else {
            let destination = format!("{}:{port}", authority.host());
            self.forward_within(req, caller, resolved, &destination)
                .await
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
                let labels = self
                    .metrics
                    .outbound_labels(&caller.identity.id(), &endpoint);
                let metrics = self.metrics.clone();
                let guard = drain.guard();
                tokio::spawn(async move {
                    let _guard = guard;
                    let Ok(upgraded) = hyper::upgrade::on(req).await else {
                        return;
                    };
                    splice(&metrics, &labels, TokioIo::new(upgraded), tunnel).await;
                });
                Response::new(empty_body())
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

    fn pool_key(caller: &Caller, endpoint: &Endpoint) -> PoolKey {
        PoolKey {
            source: caller.identity.id(),
            endpoint: endpoint.clone(),
        }
    }
}

/// The HTTP/1 server for pods' connections, with the proxy's limits.
fn http1_server() -> hyper::server::conn::http1::Builder {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_BUF_SIZE);
    builder
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

/// The HTTP status for a tunnel that could not be opened.
fn status_for(e: &TunnelError) -> StatusCode {
    match e {
        TunnelError::Refused {
            status: ResponseStatus::Denied,
            ..
        } => StatusCode::FORBIDDEN,
        _ => StatusCode::BAD_GATEWAY,
    }
}
