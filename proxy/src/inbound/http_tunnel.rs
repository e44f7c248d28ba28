//! HTTP in an inbound tunnel: served by the proxy's own HTTP server, each
//! request sent on to the pod with the caller's proven identity in
//! `strait-client-id` (whatever the caller put there is replaced). HTTP/1 and
//! HTTP/2 tunnels go over one connection to the pod in the same version; a
//! multiplexed HTTP/1 tunnel (HTTP/2 in the tunnel) over as many HTTP/1
//! connections to the pod as it has requests at once, kept for the tunnel.

use std::sync::Arc;

use strait_mesh::identity::SpiffeId;
use strait_mesh::names::CLIENT_ID_HEADER;
use strait_mesh::tunnel::Protocol;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::drain::Drain;
use crate::metrics::HttpSeries;

/// HTTP over one tunnel (`tunnel`: its TLS stream, or that with the first
/// bytes read ahead) to one pod connection, in the tunnel's version. One
/// task drives both connections (no hand-over to another task per request).
pub(super) async fn serve_http<T>(
    tunnel: T,
    upstream: TcpStream,
    protocol: Protocol,
    client: &SpiffeId,
    series: HttpSeries,
    drain: &Drain,
) -> Result<(), String>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
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
        Protocol::Http1Multiplexed => {
            let connector = PodConnector {
                pod: pod.ok_or("the pod connection has no peer address")?,
                first: Arc::new(std::sync::Mutex::new(Some(upstream))),
            };
            let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
                .pool_idle_timeout(POD_IDLE_TIMEOUT)
                .pool_timer(hyper_util::rt::TokioTimer::new())
                .build(connector);
            (PodSender::Pool(Arc::new(client)), Box::pin(async {}))
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
    let h1 = protocol.in_tunnel() == Protocol::Http1;
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
                    PodSender::H1(s) => s
                        .lock()
                        .await
                        .send_request(req)
                        .await
                        .map_err(PodError::from),
                    PodSender::H2(mut s) => s.send_request(req).await.map_err(PodError::from),
                    PodSender::Pool(client) => {
                        *req.version_mut() = http::Version::HTTP_11;
                        client.request(req).await.map_err(PodError::Pool)
                    }
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
    let io = TokioIo::new(tunnel);
    let tunnel = async move {
        match protocol.in_tunnel() {
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
    /// HTTP/1 connections to the pod, as many as the tunnel has requests at
    /// once (a multiplexed HTTP/1 tunnel).
    Pool(Arc<hyper_util::client::legacy::Client<PodConnector, hyper::body::Incoming>>),
}

/// How long one of a multiplexed tunnel's pod connections may sit idle.
const POD_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Why a request got no answer from the pod.
#[derive(Debug, thiserror::Error)]
enum PodError {
    #[error(transparent)]
    Connection(#[from] hyper::Error),
    #[error("{0}")]
    Pool(hyper_util::client::legacy::Error),
}

/// Connections to one pod: first the one opened while admitting the tunnel
/// (so a pod that does not accept is refused before any answer), then new ones.
#[derive(Clone)]
struct PodConnector {
    pod: std::net::SocketAddr,
    first: Arc<std::sync::Mutex<Option<TcpStream>>>,
}

impl tower_service::Service<http::Uri> for PodConnector {
    type Response = hyper_util::rt::TokioIo<TcpStream>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: http::Uri) -> Self::Future {
        let first = self.first.lock().unwrap_or_else(|e| e.into_inner()).take();
        let pod = self.pod;
        Box::pin(async move {
            let stream = match first {
                Some(stream) => stream,
                None => {
                    let stream = TcpStream::connect(pod).await?;
                    stream.set_nodelay(true)?;
                    stream
                }
            };
            Ok(hyper_util::rt::TokioIo::new(stream))
        })
    }
}
