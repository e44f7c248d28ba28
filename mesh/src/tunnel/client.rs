//! The sending side of a tunnel: connect, mutual TLS, the header, the
//! receiver's answer. Node proxies call node proxies with it, and the gateway
//! calls its cluster's node proxies on behalf of a remote caller.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::io::{ClientTls, ReadAhead};

use super::{Protocol, ResponseStatus, Target, TunnelHeader, TunnelResponse, server_name_for};
use crate::identity::SpiffeId;

#[derive(Debug, thiserror::Error)]
pub enum TunnelError {
    #[error(
        "connecting to {node}: {source}; is the Strait proxy or gateway running there and its port open?"
    )]
    Connect {
        node: SocketAddr,
        source: std::io::Error,
    },
    #[error("mutual TLS with {node} for {identity}: {source}")]
    Tls {
        node: SocketAddr,
        identity: SpiffeId,
        source: std::io::Error,
    },
    #[error("{node} refused {target}: {} ({message})", status.reason())]
    Refused {
        node: SocketAddr,
        target: String,
        status: ResponseStatus,
        message: String,
    },
    #[error("tunnel to {node}: {0}", node = .1)]
    Protocol(String, SocketAddr),
    #[error("no TLS configuration: {0}")]
    Config(String),
}

impl TunnelError {
    /// Whether another endpoint may be tried (no byte reached the target).
    pub fn retryable(&self) -> bool {
        match self {
            TunnelError::Connect { .. } | TunnelError::Tls { .. } => true,
            TunnelError::Refused { status, .. } => status.retryable(),
            _ => false,
        }
    }
}

/// How long a TCP connect may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the receiver may take to answer the header.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client's TLS handshake may take once TCP is connected. A
/// stopped (SIGSTOP, hung) peer still completes TCP handshakes from its
/// listen backlog and then says nothing: without this bound a tunnel to it
/// would wait forever. TLS 1.3 needs one round trip; 5 s leaves several
/// retransmissions on a lossy WAN path and equals the QUIC idle timeout, so
/// either transport gives up on a hung gateway in about the same time.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Sends `header` on an established stream and reads the receiver's answer;
/// the stream is then ready for application bytes. `node` names the peer in
/// errors.
pub async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    header: &TunnelHeader,
    node: SocketAddr,
) -> Result<S, TunnelError> {
    header
        .write_to(&mut stream)
        .await
        .map_err(|e| TunnelError::Protocol(format!("sending the header: {e}"), node))?;
    let answer = TunnelResponse::read_from(&mut stream, RESPONSE_TIMEOUT)
        .await
        .map_err(|e| TunnelError::Protocol(format!("reading the answer: {e}"), node))?;
    if !answer.is_ok() {
        return Err(TunnelError::Refused {
            node,
            target: match &header.target {
                Target::Pod { addr } => addr.to_string(),
                Target::Service { fqdn, port } => format!("{}:{port}", fqdn.as_str()),
            },
            status: answer.status,
            message: answer.message,
        });
    }
    Ok(stream)
}

/// Mutual TLS over `tcp` (to `node`) with a peer that must be `identity`;
/// the socket is read ahead ([`ReadAhead`]).
pub(crate) async fn connect_tls(
    config: Arc<rustls::ClientConfig>,
    tcp: TcpStream,
    node: SocketAddr,
    identity: &SpiffeId,
) -> Result<ClientTls, TunnelError> {
    let _ = tcp.set_nodelay(true);
    let connecting = tokio_rustls::TlsConnector::from(config)
        .connect(server_name_for(identity), ReadAhead::new(tcp));
    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, connecting).await {
        Ok(connected) => connected.map_err(|source| TunnelError::Tls {
            node,
            identity: identity.clone(),
            source,
        }),
        Err(_) => Err(TunnelError::Tls {
            node,
            identity: identity.clone(),
            source: std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "no TLS handshake within {TLS_HANDSHAKE_TIMEOUT:?}: the peer accepted TCP but does not answer (hung or stopped?)"
                ),
            ),
        }),
    }
}

/// Opens a tunnel to `pod` through the node proxy at `node`: TCP, mutual TLS
/// (the config presents the caller; the server must be `identity`, named in
/// SNI), the header (with `source` when speaking for someone else, and
/// `end_to_end` when the caller's proxy proves itself inside), and the answer.
pub async fn open_to_pod(
    config: Arc<rustls::ClientConfig>,
    node: SocketAddr,
    pod: SocketAddr,
    identity: &SpiffeId,
    protocol: Protocol,
    source: Option<SpiffeId>,
    end_to_end: bool,
) -> Result<ClientTls, TunnelError> {
    let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(node))
        .await
        .map_err(|_| TunnelError::Connect {
            node,
            source: std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out"),
        })?
        .map_err(|source| TunnelError::Connect { node, source })?;
    let tls = connect_tls(config, tcp, node, identity).await?;
    let target = Target::pod(pod).map_err(|e| TunnelError::Protocol(e.to_string(), node))?;
    let mut header = TunnelHeader::new(target, protocol);
    header.source = source;
    header.end_to_end = end_to_end;
    handshake(tls, &header, node).await
}

/// The server name of end-to-end sessions: the destination's proxy answers as
/// the tunnel's target pod, whatever the name.
pub const END_TO_END_SERVER_NAME: &str = "end-to-end.identity.strait.internal";

/// Opens the end-to-end session inside `stream`, a tunnel whose header said
/// `end_to_end` and was answered OK: mutual TLS as the caller (`config`
/// presents the caller pod's certificate and accepts the destination's
/// workloads), then `inner` (the Service the caller asked for) and the
/// destination's own answer. `peer` names the first hop in errors.
pub async fn end_to_end<S>(
    stream: S,
    config: Arc<rustls::ClientConfig>,
    inner: &TunnelHeader,
    peer: SocketAddr,
) -> Result<tokio_rustls::client::TlsStream<S>, TunnelError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let name =
        rustls::pki_types::ServerName::try_from(END_TO_END_SERVER_NAME).expect("a valid DNS name");
    let tls = tokio::time::timeout(
        RESPONSE_TIMEOUT,
        tokio_rustls::TlsConnector::from(config).connect(name, stream),
    )
    .await
    .map_err(|_| {
        TunnelError::Protocol("end-to-end TLS with the destination timed out".into(), peer)
    })?
    .map_err(|e| {
        TunnelError::Protocol(format!("end-to-end TLS with the destination: {e}"), peer)
    })?;
    handshake(tls, inner, peer).await
}
