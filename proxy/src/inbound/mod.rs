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
use strait_mesh::names::{Carrier, may_speak_for};
use strait_mesh::tunnel::{
    DEFAULT_READ_TIMEOUT, Protocol, ResponseStatus, Target, TunnelHeader, TunnelResponse,
};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::LazyConfigAcceptor;

use crate::detect::PrefixedIo;
use crate::drain::{Drain, serve_connections};
use crate::identity::{PodIdentities, parse_server_name};
use crate::metrics::{ProxyMetrics, TcpLabels};
use crate::view::{LocalPod, LocalPods};
use http_tunnel::serve_http;
use opening::{FIRST_BYTES_TIMEOUT, Guarded, Opening, opening};

mod end_to_end;
mod http_tunnel;
mod opening;

/// How long a peer may take for the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long connecting to a local pod may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Inbound {
    pub node: String,
    pub identities: Arc<PodIdentities>,
    pub pods: Arc<dyn LocalPods>,
    pub metrics: ProxyMetrics,
    /// Refusals are logged once a minute per peer at most (all are counted).
    pub refusal_log: strait_mesh::telemetry::PeerLogLimit,
}

impl Inbound {
    /// Serves connections until the drain starts. Then HTTP tunnels finish
    /// the request in flight and close (an idle pooled tunnel at once, so
    /// other proxies' pools do not hold the drain: a node's proxy is replaced
    /// sooner); opaque tunnels run until their ends close or the drain times out.
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        drain: Drain,
        limit: strait_mesh::limits::ConnLimit,
    ) {
        let draining = drain.clone();
        // Past the limit a peer proxy's connection is closed before TLS: its
        // handshake fails and the tunnel goes to another endpoint.
        serve_connections(
            listener,
            drain,
            "inbound",
            limit,
            b"",
            move |stream, peer| {
                let (this, drain) = (self.clone(), draining.clone());
                async move {
                    if let Err(e) = this.handle(stream, peer, drain).await {
                        tracing::debug!(%peer, "inbound connection: {e}");
                    }
                }
            },
        )
        .await
    }

    /// The TLS handshake as the identity the client asked for (server name).
    async fn accept(&self, stream: TcpStream) -> Result<Accepted, String> {
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
            .into_stream(config.clone())
            .await
            .map_err(|e| format!("TLS handshake: {e}"))?;
        Ok((tls, served, config))
    }

    async fn handle(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        drain: Drain,
    ) -> Result<(), String> {
        let (mut tls, served, config) =
            tokio::time::timeout(HANDSHAKE_TIMEOUT, self.accept(stream))
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
                self.metrics.inbound_refused(refusal.reason());
                if self.refusal_log.allow(&client.to_string()) {
                    tracing::info!(%peer, client = %client, "refused: {refusal}");
                }
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
        if header.end_to_end {
            // Boxed, as the opaque path: only these tunnels pay for it.
            return Box::pin(async move {
                let pod_addr = upstream.peer_addr().map_err(|e| e.to_string())?;
                let accepted =
                    end_to_end::accept(tls, config, self.pods.as_ref(), &caller, pod_addr).await;
                let session = match accepted {
                    Ok(session) => session,
                    Err(end_to_end::Failure::Refused(refusal)) => {
                        self.metrics.inbound_refused(refusal.reason());
                        if self.refusal_log.allow(&caller.to_string()) {
                            tracing::warn!(%peer, claimed = %caller, "end-to-end caller refused: {refusal}");
                        }
                        return Err(refusal.to_string());
                    }
                    Err(end_to_end::Failure::Broken(e)) => return Err(e),
                };
                self.metrics.end_to_end_proven();
                let labels = self.metrics.inbound_labels(
                    &session.proven,
                    &pod,
                    session.service.as_deref(),
                );
                self.deliver(session.inner, upstream, session.protocol, &session.proven, labels, drain)
                    .await
            })
            .await;
        }
        let labels = self.metrics.inbound_labels(&caller, &pod, None);
        self.deliver(tls, upstream, header.protocol, &caller, labels, drain)
            .await
    }

    /// Delivers an admitted tunnel to its pod by the protocol its sender named.
    async fn deliver<T>(
        &self,
        tls: T,
        upstream: TcpStream,
        protocol: Protocol,
        caller: &SpiffeId,
        labels: TcpLabels,
        drain: Drain,
    ) -> Result<(), String>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let caller = caller.clone();
        self.metrics.tcp_open(&labels);
        let result = match protocol {
            // The sender detected HTTP (or was told by its client): no second
            // detection here. Requests are counted per caller, and the pod
            // learns who called (CLIENT_ID_HEADER), which no one else can set.
            Protocol::Http1 | Protocol::Http2 | Protocol::Http1Multiplexed => {
                let series = self.metrics.http(&labels);
                let result = serve_http(tls, upstream, protocol, &caller, series, &drain).await;
                self.metrics.tcp_close(&labels, 0, 0);
                result
            }
            // Boxed: its state (the first bytes' race, a second HTTP server
            // type) would otherwise grow every connection's task, idle ones too.
            Protocol::Opaque => {
                Box::pin(self.serve_opaque(tls, upstream, &caller, &labels, &drain)).await
            }
        };
        result.map_err(|e| format!("from {caller}: {e}"))
    }

    /// A tunnel the sender did not read as HTTP: read as HTTP here if its
    /// first bytes are, so no caller can bring its own `strait-client-id`
    /// ([`opening`] says how); else spliced.
    async fn serve_opaque<T>(
        &self,
        mut tls: T,
        mut upstream: TcpStream,
        caller: &SpiffeId,
        labels: &TcpLabels,
        drain: &Drain,
    ) -> Result<(), String>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let opened = opening(&mut tls, &upstream, FIRST_BYTES_TIMEOUT).await;
        let spliced = match opened {
            Ok(Opening::Http(protocol, read)) => {
                let series = self.metrics.http(labels);
                let tunnel = PrefixedIo::new(read, tls);
                let result = serve_http(tunnel, upstream, protocol, caller, series, drain).await;
                self.metrics.tcp_close(labels, 0, 0);
                return result;
            }
            Ok(Opening::Opaque(read)) => {
                strait_mesh::io::splice(&mut PrefixedIo::new(read, tls), &mut upstream).await
            }
            Ok(Opening::PodFirst(read)) => {
                strait_mesh::io::splice(&mut Guarded::new(read, tls), &mut upstream).await
            }
            Ok(Opening::Silent) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("neither side spoke within {FIRST_BYTES_TIMEOUT:?}: closed"),
            )),
            Err(e) => Err(e),
        };
        match spliced {
            Ok((from_client, to_client)) => {
                self.metrics.tcp_close(labels, from_client, to_client);
                Ok(())
            }
            Err(e) => {
                self.metrics.tcp_close(labels, 0, 0);
                if e.kind() == std::io::ErrorKind::PermissionDenied {
                    tracing::info!(%caller, "tunnel closed: {e}");
                }
                Err(e.to_string())
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
                if may_speak_for(Carrier::NodeProxy, client, source)
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
        match (&header.source, header.end_to_end) {
            (None, true) => return Err(Refusal::EndToEndDirect),
            // The gateway's word is not enough: the caller proves itself.
            (Some(source), false) if self.identities.end_to_end().requires() => {
                return Err(Refusal::SourceWithoutProof {
                    claimed: source.clone(),
                });
            }
            _ => {}
        }
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

/// A handshake done: the session, the identity asked for (namespace,
/// ServiceAccount) and the server config it was answered with.
type Accepted = (PeerTls, (String, String), Arc<rustls::ServerConfig>);

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
    #[error("end-to-end sessions come through this cluster's gateway, with the caller it carries")]
    EndToEndDirect,
    #[error(
        "the gateway names {claimed} as the caller without the caller's end-to-end proof: every node proxy must be a version that sends it"
    )]
    SourceWithoutProof { claimed: SpiffeId },
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
    /// The `reason` label of `inbound_refusals_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::SourceClaim { .. } => "source-claim",
            Refusal::NotAPod => "not-a-pod",
            Refusal::EndToEndDirect => "end-to-end-direct",
            Refusal::SourceWithoutProof { .. } => "no-proof",
            Refusal::UnknownPod { .. } => "unknown-pod",
            Refusal::NotThatIdentity { .. } => "not-that-identity",
            Refusal::Connect { .. } | Refusal::ConnectTimeout { .. } => "pod-unavailable",
        }
    }

    pub fn status(&self) -> ResponseStatus {
        match self {
            Refusal::SourceClaim { .. }
            | Refusal::NotThatIdentity { .. }
            | Refusal::SourceWithoutProof { .. } => ResponseStatus::Denied,
            Refusal::NotAPod | Refusal::UnknownPod { .. } => ResponseStatus::NotFound,
            Refusal::EndToEndDirect => ResponseStatus::BadHeader,
            Refusal::Connect { .. } | Refusal::ConnectTimeout { .. } => {
                ResponseStatus::TargetUnavailable
            }
        }
    }
}

/// The SPIFFE ID a local pod runs as.
pub fn pod_identity(trust_domain: &str, pod: &LocalPod) -> Result<SpiffeId, SpiffeIdError> {
    SpiffeId::new(trust_domain, &pod.namespace, &pod.service_account)
}
