//! The inbound side (port 4143): mutual TLS from other node proxies, then a
//! tunnel header naming a pod; delivered only if that pod runs on this node
//! and is the identity the client asked for (the server name). Everything
//! else is refused with a [`TunnelResponse`] that says why, before any byte
//! reaches a pod.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use strait_mesh::identity::protocol::PodRef;
use strait_mesh::identity::tls;
use strait_mesh::identity::{SpiffeId, SpiffeIdError};
use strait_mesh::io::{ReadAhead, ServerTls as PeerTls};
use strait_mesh::names::{CLIENT_ID_HEADER, Carrier, may_speak_for_others};
use strait_mesh::tunnel::{
    DEFAULT_READ_TIMEOUT, Protocol, ResponseStatus, Target, TunnelHeader, TunnelResponse,
};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::LazyConfigAcceptor;

use crate::drain::{Drain, serve_connections};
use crate::identity::{PodIdentities, parse_server_name};
use crate::metrics::{HttpSeries, ProxyMetrics, TcpLabels};
use crate::view::{LocalPod, LocalPods};

/// How long a peer may take for the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long connecting to a local pod may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Inbound {
    pub node: String,
    pub identities: Arc<PodIdentities>,
    pub pods: Arc<dyn LocalPods>,
    pub metrics: ProxyMetrics,
}

impl Inbound {
    /// Serves connections until the drain starts. Then HTTP tunnels finish
    /// the request in flight and close (an idle pooled tunnel at once, so
    /// other proxies' pools do not hold the drain: a node's proxy is replaced
    /// sooner); opaque tunnels run until their ends close or the drain times out.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, drain: Drain) {
        let draining = drain.clone();
        serve_connections(listener, drain, "inbound", move |stream, peer| {
            let (this, drain) = (self.clone(), draining.clone());
            async move {
                if let Err(e) = this.handle(stream, peer, drain).await {
                    tracing::debug!(%peer, "inbound connection: {e}");
                }
            }
        })
        .await
    }

    /// The TLS handshake as the identity the client asked for (server name).
    async fn accept(&self, stream: TcpStream) -> Result<(PeerTls, (String, String)), String> {
        let start =
            LazyConfigAcceptor::new(rustls::server::Acceptor::default(), ReadAhead::new(stream))
                .await
                .map_err(|e| format!("reading the ClientHello: {e}"))?;
        let served = start
            .client_hello()
            .server_name()
            .and_then(parse_server_name)
            .ok_or("the client named no Strait identity (server name <sa>.<ns>.identity.strait.internal)")?;
        let pod = self
            .pods
            .local_pod_running_as(&served.0, &served.1)
            .ok_or_else(|| {
                format!(
                    "no pod on node {} runs as {}/{}: refusing the handshake",
                    self.node, served.0, served.1
                )
            })?;
        let identity = self
            .identities
            .for_pod(
                &PodRef {
                    namespace: pod.namespace.clone(),
                    name: pod.name.clone(),
                },
                &pod.service_account,
            )
            .await
            .map_err(|e| format!("identity of {}/{}: {e}", pod.namespace, pod.name))?;
        let config = self
            .identities
            .server_config(&identity)
            .map_err(|e| e.to_string())?;
        let tls = start
            .into_stream(config)
            .await
            .map_err(|e| format!("TLS handshake: {e}"))?;
        Ok((tls, served))
    }

    async fn handle(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        drain: Drain,
    ) -> Result<(), String> {
        let (mut tls, served) = tokio::time::timeout(HANDSHAKE_TIMEOUT, self.accept(stream))
            .await
            .map_err(|_| "TLS handshake timed out".to_string())??;
        let client = tls::peer_identity(tls.get_ref().1.peer_certificates())
            .map_err(|e| format!("peer identity: {e}"))?;
        let header = match TunnelHeader::read_from(&mut tls, DEFAULT_READ_TIMEOUT).await {
            Ok(h) => h,
            Err(e) => {
                if let Some(answer) = TunnelResponse::for_header_error(&e) {
                    let _ = answer.write_to(&mut tls).await;
                }
                return Err(format!("tunnel header from {client}: {e}"));
            }
        };
        let Admitted {
            caller,
            pod,
            upstream,
        } = match self.admit(&header, &client, &served).await {
            Ok(admitted) => admitted,
            Err(refusal) => {
                tracing::info!(%peer, client = %client, "refused: {refusal}");
                let _ = TunnelResponse::refused(refusal.status(), refusal.to_string())
                    .write_to(&mut tls)
                    .await;
                let _ = tls.shutdown().await;
                return Err(refusal.to_string());
            }
        };
        let _ = upstream.set_nodelay(true);
        TunnelResponse::ok()
            .write_to(&mut tls)
            .await
            .map_err(|e| format!("answering {client}: {e}"))?;
        let labels = TcpLabels::inbound(&caller, &pod);
        self.metrics.tcp_open(&labels);
        match header.protocol {
            // The sender detected HTTP (or was told by its client): no second
            // detection here. Requests are counted per caller, and the pod
            // learns who called (CLIENT_ID_HEADER), which no one else can set.
            Protocol::Http1 | Protocol::Http2 => {
                let result = serve_http(
                    tls,
                    upstream,
                    header.protocol,
                    &caller,
                    self.metrics.http(&labels),
                    &drain,
                )
                .await;
                self.metrics.tcp_close(&labels, 0, 0);
                result
            }
            Protocol::Opaque => {
                let mut upstream = upstream;
                let result = strait_mesh::io::splice(&mut tls, &mut upstream).await;
                let (from_client, to_client) = result.unwrap_or((0, 0));
                self.metrics.tcp_close(&labels, from_client, to_client);
                Ok(())
            }
        }
    }
    /// Who the caller is, which local pod it reaches, and a connection to
    /// it: or why not.
    async fn admit(
        &self,
        header: &TunnelHeader,
        client: &SpiffeId,
        served: &(String, String),
    ) -> Result<Admitted, Refusal> {
        // A node proxy speaks for its own pods only; only this cluster's
        // gateway carries a remote caller's identity (it checked the caller's
        // own proof and the Service's policy). Anyone else claiming another
        // caller is a misconfiguration or an attack.
        let caller = match &header.source {
            Some(source)
                if may_speak_for_others(Carrier::NodeProxy, client)
                    && client.trust_domain() == self.identities.trust_domain() =>
            {
                source.clone()
            }
            Some(source) => {
                return Err(Refusal::SourceClaim {
                    client: client.clone(),
                    claimed: source.clone(),
                });
            }
            None => client.clone(),
        };
        let Target::Pod { addr } = header.target else {
            return Err(Refusal::NotAPod);
        };
        let Some(pod) = self.pods.local_pod(addr.ip()) else {
            return Err(Refusal::UnknownPod {
                ip: addr.ip(),
                node: self.node.clone(),
            });
        };
        if (pod.namespace.as_str(), pod.service_account.as_str())
            != (served.0.as_str(), served.1.as_str())
        {
            return Err(Refusal::NotThatIdentity {
                pod: format!("{}/{}", pod.namespace, pod.name),
                runs_as: format!("{}/{}", pod.namespace, pod.service_account),
                asked: format!("{}/{}", served.0, served.1),
            });
        }
        let upstream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(source)) => {
                return Err(Refusal::Connect {
                    pod: format!("{}/{}", pod.namespace, pod.name),
                    addr,
                    source,
                });
            }
            Err(_) => {
                return Err(Refusal::ConnectTimeout {
                    pod: format!("{}/{}", pod.namespace, pod.name),
                    addr,
                });
            }
        };
        Ok(Admitted {
            caller,
            pod,
            upstream,
        })
    }
}

/// An admitted tunnel: its caller, the pod and a connection to it.
struct Admitted {
    caller: SpiffeId,
    pod: LocalPod,
    upstream: TcpStream,
}

/// Why a node proxy refuses a tunnel; the status is its answer.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("{client} may not speak for {claimed}: only gateways may carry a caller's identity")]
    SourceClaim { client: SpiffeId, claimed: SpiffeId },
    #[error("a node proxy delivers to pods only; services are resolved by the sender")]
    NotAPod,
    #[error("no pod with IP {ip} runs on node {node}")]
    UnknownPod { ip: IpAddr, node: String },
    #[error("pod {pod} runs as {runs_as}, not as the identity the client asked for ({asked})")]
    NotThatIdentity {
        pod: String,
        runs_as: String,
        asked: String,
    },
    #[error("connecting to pod {pod} at {addr}: {source}")]
    Connect {
        pod: String,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("pod {pod} at {addr} did not accept within {CONNECT_TIMEOUT:?}")]
    ConnectTimeout { pod: String, addr: SocketAddr },
}

impl Refusal {
    pub fn status(&self) -> ResponseStatus {
        match self {
            Refusal::SourceClaim { .. } | Refusal::NotThatIdentity { .. } => ResponseStatus::Denied,
            Refusal::NotAPod | Refusal::UnknownPod { .. } => ResponseStatus::NotFound,
            Refusal::Connect { .. } | Refusal::ConnectTimeout { .. } => {
                ResponseStatus::TargetUnavailable
            }
        }
    }
}

/// HTTP over one tunnel to one pod connection, in the tunnel's version. One
/// task drives both connections (no hand-over to another task per request).
async fn serve_http(
    tls: PeerTls,
    upstream: TcpStream,
    protocol: Protocol,
    client: &SpiffeId,
    series: HttpSeries,
    drain: &Drain,
) -> Result<(), String> {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let client_id = http::HeaderValue::from_str(&client.to_string())
        .map_err(|e| format!("caller identity as a header: {e}"))?;
    let pod = upstream.peer_addr().ok();
    let (sender, pod_connection): (PodSender, BoxFuture) = match protocol {
        Protocol::Http2 => {
            let (sender, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(upstream))
                    .await
                    .map_err(|e| format!("HTTP/2 to pod {pod:?}: {e}"))?;
            (PodSender::H2(sender), Box::pin(quietly(conn)))
        }
        _ => {
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(upstream))
                .await
                .map_err(|e| format!("HTTP/1 to pod {pod:?}: {e}"))?;
            (
                PodSender::H1(Arc::new(tokio::sync::Mutex::new(sender))),
                Box::pin(quietly(conn)),
            )
        }
    };
    let h1 = protocol != Protocol::Http2;
    let closing = drain.clone();
    let service =
        hyper::service::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
            let (sender, series, client_id) = (sender.clone(), series.clone(), client_id.clone());
            let drain_closing = closing.clone();
            async move {
                crate::hop::strip(req.headers_mut());
                req.headers_mut().insert(CLIENT_ID_HEADER, client_id);
                series.request();
                let started = std::time::Instant::now();
                let result = match sender {
                    PodSender::H1(s) => s.lock().await.send_request(req).await,
                    PodSender::H2(mut s) => s.send_request(req).await,
                };
                series.response(
                    result.as_ref().ok().map(|r| r.status()),
                    started.elapsed().as_secs_f64(),
                );
                result.map(|mut response| {
                    // This tunnel's HTTP/1 connection is tied to one pod
                    // connection: when the pod closes it, the tunnel closes too
                    // (the sending proxy then opens a new one).
                    // Or this proxy is shutting down: the sender's pool
                    // drops the tunnel after this answer, not during the next.
                    let closing = crate::hop::says_close(response.headers())
                        || (h1 && drain_closing.is_closing());
                    crate::hop::strip(response.headers_mut());
                    if closing {
                        response.headers_mut().insert(
                            http::header::CONNECTION,
                            http::HeaderValue::from_static("close"),
                        );
                    }
                    response
                })
            }
        });
    let io = TokioIo::new(tls);
    let tunnel = async move {
        match protocol {
            Protocol::Http2 => {
                let connection = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(io, service);
                drain
                    .serve(std::pin::pin!(connection), |c| c.graceful_shutdown())
                    .await
            }
            _ => {
                let connection =
                    hyper::server::conn::http1::Builder::new().serve_connection(io, service);
                drain
                    .serve(std::pin::pin!(connection), |c| c.graceful_shutdown())
                    .await
            }
        }
    };
    // The pod's connection ends once the tunnel's (holding its sender) has.
    let (served, ()) = tokio::join!(tunnel, pod_connection);
    served.map_err(|e| format!("HTTP in the tunnel: {e}"))
}

type BoxFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// A pod connection's future, its error only logged.
async fn quietly<E: std::fmt::Display>(
    connection: impl std::future::Future<Output = Result<(), E>>,
) {
    if let Err(e) = connection.await {
        tracing::debug!("HTTP to the pod: {e}");
    }
}

#[derive(Clone)]
enum PodSender {
    /// One HTTP/1 connection: requests in turn.
    H1(Arc<tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<hyper::body::Incoming>>>),
    H2(hyper::client::conn::http2::SendRequest<hyper::body::Incoming>),
}

/// The SPIFFE ID a local pod runs as.
pub fn pod_identity(trust_domain: &str, pod: &LocalPod) -> Result<SpiffeId, SpiffeIdError> {
    SpiffeId::new(trust_domain, &pod.namespace, &pod.service_account)
}
